"""Train-step throughput on 8 simulated CPU devices: the config's sharding plan vs replication.

  python -m benchmarks.throughput [--sizes tiny,small] [--optimizers adamw,kron] [--steps 10]

For each model size and optimizer, the trainer's run of ``configs/lm.py``
(``trainers/build.py``: the config's whole optimizer section, its plan, the train step
of ``trainers/steps.py``) runs twice: as configured, and with
``config.sharding_strategy = [(".*", "replicate()")]``, every param and state leaf
replicated and so the params' layout too (plain data parallelism: Kron, Shampoo and
Muon do every block's work on every device). The batch is split over "data" in both.
Compilation and two warm-up steps are excluded. Prints a markdown table.
"""

import os

from trainers import ONE_BLAS_THREAD

os.environ.setdefault(*ONE_BLAS_THREAD)

import itertools

import flax.linen as nn
import jax

import bv_sharding as bvs
from benchmarks.timing import WARMUP, seconds_per_step
from configs import lm
from trainers import build, cli, optimizers, steps
from trainers.input import batching

REPLICATED = ((".*", "replicate()"),)


def setup(config, num_batches: int) -> tuple:
  """``(mesh, run, train_step, batches)`` of ``config``'s run on this host's devices.

  ``run`` is the :class:`trainers.build.Run`; ``batches`` are ``num_batches`` global batches.
  """
  mesh = bvs.make_mesh(config.mesh, axis_types=build.axis_types(config))
  run = build.build(config, mesh)
  sharding = steps.batch_sharding(mesh, steps.data_axes(mesh, config.sharding_rules))
  local = run.task.batches(run.task.train, global_batch=config.batch_size, seed=0)
  batches = [batching.to_global(b, sharding) for b in itertools.islice(local, num_batches)]
  train_step = steps.make_train_step(run.loss, run.tx, run.plan, sharding)
  return mesh, run, train_step, batches


def init_state(run) -> dict:
  """``run``'s born-sharded state (under ``jax.set_mesh`` of its mesh)."""
  return steps.init_state(run.init, run.tx, run.plan)


def steps_per_sec(config, num_steps: int) -> float:
  """Steps per second of ``config``'s train step."""
  mesh, run, train_step, batches = setup(config, WARMUP + num_steps)
  with jax.set_mesh(mesh), nn.logical_axis_rules(config.sharding_rules):
    _, seconds = seconds_per_step(train_step, init_state(run), batches, num_steps)
  return 1 / seconds


def lm_config(size: str, optimizer: str, replicated: bool = False):
  """configs/lm.py of ``size`` with ``optimizer``, batch 16; ``replicated``: every param and
  state leaf replicated, so the optimizer's layout is too (plain data parallelism)."""
  config = lm.get_config(f"size={size}")
  config.batch_size, config.optax_name = 16, optimizer
  if replicated:
    config.sharding_strategy = REPLICATED
  return config


@cli.command
def main(argv=None):
  parser = cli.Parser("python -m benchmarks.throughput", __doc__)
  parser.add_argument("--sizes", default="tiny,small")
  parser.add_argument("--optimizers", default=",".join(optimizers.OPTIMIZERS))
  parser.add_argument("--steps", type=int, default=10, help="timed steps per measurement")
  args = parser.parse_args(argv)
  jax.config.update("jax_num_cpu_devices", 8)
  print(
      f"{jax.device_count()} {jax.devices()[0].platform} devices, {args.steps} timed steps "
      f"after {WARMUP} warm-up; batch split over 'data' in both columns\n"
  )
  print("| size | optimizer | plan steps/s | replicated steps/s | plan / replicated |")
  print("|---|---|---|---|---|")
  for size, optimizer in itertools.product(args.sizes.split(","), args.optimizers.split(",")):
    planned_rate = steps_per_sec(lm_config(size, optimizer), args.steps)
    replicated_rate = steps_per_sec(lm_config(size, optimizer, replicated=True), args.steps)
    print(
        f"| {size} | {optimizer} | {planned_rate:.2f} | {replicated_rate:.2f} | "
        f"{planned_rate / replicated_rate:.2f} |",
        flush=True,
    )


if __name__ == "__main__":
  main()
