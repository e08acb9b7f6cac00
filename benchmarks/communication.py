"""Communication benchmark: collective bytes per device of one jitted optimizer update.

Params and grads are sharded by each placement (``benchmarks/placements.py``), the
update is compiled for 8 simulated CPU devices and the collectives are read off the
compiled HLO as wire bytes per device (``benchmarks.traffic``: all-gather
result*(g-1)/g, reduce-scatter operand*(g-1)/g, all-reduce 2*result*(g-1)/g); the
state bytes per device are printed next to them. Model: a small
Llama (V=8192, C=512, F=2048, 2 unscanned layers); ``zoo.optimizers(block_size=128)``:
distributed_shampoo blocks of 128, the project's shampoo 64, tearfree_layout 32 and
kron_blocks 256 (the registry's default).

  python -m benchmarks.communication [--optimizers kron,psgd_kron] [--factor_rows]

``--factor_rows`` adds Kron's factors on rows next to the default's columns
(the ``preconditioner(dim=0)`` op).
"""

import os

from trainers import ONE_BLAS_THREAD

os.environ.setdefault(*ONE_BLAS_THREAD)

import jax

jax.config.update("jax_num_cpu_devices", 8)

import optax  # noqa: E402

import bv_sharding as bvs  # noqa: E402
from benchmarks import placements, shapes, traffic, zoo  # noqa: E402
from trainers.settings import cli  # noqa: E402

MB = 1e6


def update_traffic(tx, params_shape, opt_shape, placement) -> float:
  """Wire bytes per device of one jitted ``tx.update`` + apply under ``placement``."""

  def update(params, opt, grads):
    updates, opt = tx.update(grads, opt, params)
    return optax.apply_updates(params, updates), opt

  step = jax.jit(
      update,
      in_shardings=(placement.params, placement.opt, placement.params),
      out_shardings=(placement.params, placement.opt),
  )
  return traffic.wire_bytes(step.lower(params_shape, opt_shape, params_shape).compile().as_text())


@cli.command
def main(argv=None):
  parser = cli.Parser("python -m benchmarks.communication", __doc__)
  parser.add_argument(
      "--optimizers", default="", help="comma-separated subset of benchmarks/zoo.py"
  )
  parser.add_argument(
      "--factor_rows", action="store_true", help="add a placement with Kron factors on rows"
  )
  args = parser.parse_args(argv)
  params = shapes.llama_params(d=512, vocab=8192, ff=2048)
  params = {
      "embed": params["embed"],
      "layers_0": params["block"],
      "layers_1": params["block"],
      "final_norm": params["final_norm"],
      "head": params["head"],
  }
  mesh = bvs.make_mesh([("data", -1)])
  chosen = [n for n in args.optimizers.split(",") if n]
  print("| optimizer | placement | update traffic MB/device | state MB/device |")
  print("|---|---|---|---|")
  for name, tx in zoo.optimizers(params, block_size=128).items():
    if chosen and name not in chosen:
      continue
    opt = jax.eval_shape(tx.init, params)
    for label, placement in placements.placements(
        params, opt, mesh, name in zoo.SECOND_ORDER, args.factor_rows
    ).items():
      traffic = update_traffic(tx, params, opt, placement)
      state = placement.state_bytes_per_device("opt")
      print(f"| {name} | {label} | {traffic / MB:.1f} | {state / MB:.1f} |", flush=True)


if __name__ == "__main__":
  main()
