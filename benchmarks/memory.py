"""Memory benchmark: params + optimizer-state bytes per device / (total / N).

Llama-shaped 125M and 7B trees (abstract: nothing is allocated), N = 8 and 256
(``AbstractMesh``), every optimizer of ``benchmarks/zoo.py``, the default plan next to
the baselines of ``benchmarks/placements.py``. Goal: ratio <= 1.02.

Then the trainer's own plans on 2-D meshes: configs/lm_tp_fsdp.py and
configs/lm_7b_pod.py (data x model) on 256 abstract devices, scanned and unscanned,
per optimizer: the run trainers/train.py builds (trainers/build.py: the config's
optimizer section, the params' layout; Kron/Shampoo with the param's fixed tiles, and
"kron:local"/"shampoo:local" with shard-local blocks; SOAP on Shampoo's tiles).
Goal: ratio <= 1.05. The ideal is the state's bytes in the form that does not depend on the
mesh (``trainers/stored.py``: a pool's padding, where SOAP keeps its state where it runs,
counts against the ratio).

  python -m benchmarks.memory [--only_2d]
"""

import itertools

import flax.linen as nn
import jax
import jax.numpy as jnp

import bv_sharding as bvs
from benchmarks import placements, zoo
from configs import lm_7b_pod, lm_tp_fsdp
from trainers import MiB, build
from trainers.models import get_model
from trainers.settings import cli

GiB = 1024 * MiB
TRAINER_CONFIGS = {
    "lm_tp_fsdp": lm_tp_fsdp.get_config("size=small"),
    "lm_7b_pod": lm_7b_pod.get_config(),
}
TRAINER_OPTIMIZERS = (
    "adamw",
    "adafactor",
    "kron",
    "kron:local",
    "shampoo",
    "shampoo:local",
    "muon",
    "soap",
)


def llama_shape(size: str):
  model = get_model("llama", size=size)
  tokens = jnp.zeros((1, 8), jnp.int32)
  return nn.unbox(jax.eval_shape(model.init, jax.random.key(0), tokens)["params"])


def rows(size: str, devices: int):
  params = llama_shape(size)
  mesh = bvs.make_abstract_mesh([("data", -1)], devices)
  for name, tx in zoo.optimizers(params, block_size=1024).items():
    opt = jax.eval_shape(tx.init, params)
    for placement, p in placements.placements(params, opt, mesh, name in zoo.SECOND_ORDER).items():
      ratio = p.plan.bytes_per_device / (p.plan.total_bytes / devices)
      yield (
          size,
          devices,
          name,
          placement,
          p.plan.total_bytes / GiB,
          p.plan.bytes_per_device / MiB,
          ratio,
      )


def trainer_run(config, optimizer: str, scan: bool, devices: int = 256) -> build.Run:
  """The run trainers/train.py builds for ``config`` with ``optimizer`` and ``scan_layers``
  on ``devices`` abstract devices (``trainers/build.py``): its plan, and its state's plan as
  checkpointed (``run.stored.plan``, the same on any mesh)."""
  config = zoo.train_with(config.copy_and_resolve_references(), optimizer)
  config.model.scan_layers = scan
  return build.build(config, bvs.make_abstract_mesh(config.mesh, devices))


def ideal_ratio(run: build.Run) -> float:
  """Bytes per device of ``run``'s plan over the ideal: its state's bytes as checkpointed
  (the same on any mesh), spread evenly."""
  plan = run.plan
  return plan.bytes_per_device / (run.stored.plan.total_bytes / plan.num_devices)


def trainer_table():
  print("| config | mesh | scan_layers | optimizer | MiB/device | ratio to ideal |")
  print("|---|---|---|---|---|---|")
  for (name, config), scan in itertools.product(TRAINER_CONFIGS.items(), (False, True)):
    for optimizer in TRAINER_OPTIMIZERS:
      run = trainer_run(config, optimizer, scan)
      p, ratio = run.plan, ideal_ratio(run)
      mark = "" if ratio <= 1.05 else " (over 1.05)"
      print(
          f"| {name} | {dict(p.mesh.shape)} | {scan} | {optimizer} | "
          f"{p.bytes_per_device / 2**20:.1f} | {ratio:.3f}{mark} |",
          flush=True,
      )


def one_d_table():
  print("| model | N | optimizer | placement | total GiB | MiB/device | ratio to ideal |")
  print("|---|---|---|---|---|---|---|")
  for size in ("125m", "7b"):
    for devices in (8, 256):
      for size_, n, name, placement, total, per_device, ratio in rows(size, devices):
        mark = "" if placement != "default" or ratio <= 1.02 else " (over 1.02)"
        print(
            f"| {size_} | {n} | {name} | {placement} | {total:.2f} | {per_device:.1f} | "
            f"{ratio:.3f}{mark} |",
            flush=True,
        )


@cli.command
def main(argv=None):
  parser = cli.Parser("python -m benchmarks.memory", __doc__)
  parser.add_argument("--only_2d", action="store_true", help="only the trainer's 2-D plans")
  if not parser.parse_args(argv).only_2d:
    one_d_table()
    print()
  trainer_table()


if __name__ == "__main__":
  main()
