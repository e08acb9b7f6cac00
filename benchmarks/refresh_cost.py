"""SOAP's basis refresh: what a refresh step costs against the other steps, and amortised.

  python -m benchmarks.refresh_cost [--sizes tiny,small] [--cycles 2]

For each size of ``configs/lm.py`` (batch 16, 8 simulated devices) the trainer's compiled
step runs with ``soap``, then with ``adamw``, each step timed alone (dispatched and waited
for). SOAP refreshes its bases (a power iteration and a QR per block, under
``lax.cond``) on the steps whose count is a multiple of ``precondition_frequency`` (10): a
row gives the median milliseconds of those steps, of the other steps (the first two of each
run left out: they compile and settle), their mean over one period (the amortised step),
and adamw's median in the same run, with the ratios. The update's GFLOP per device are XLA's
count (``cost_analysis``) of the optimizer update alone, compiled at a refresh count and at
another one (the counts fixed, so XLA drops the untaken branch); LAPACK's QR and ``eigh`` are
calls XLA does not count, so these are the matmuls around them. The forward and backward
pass's GFLOP per device (the adamw step's count less its update's) are beside them.
"""

import os

from trainers import ONE_BLAS_THREAD

os.environ.setdefault(*ONE_BLAS_THREAD)  # Before numpy loads OpenBLAS (trainers/__init__.py).

import statistics
import time

import flax.linen as nn
import jax
import optax

from benchmarks.throughput import init_state, lm_config, setup
from trainers.settings import cli

SETTLE = 2  # Steps of each run left out of the medians (compile, then caches).
PERIOD = 10  # soap's precondition_frequency in the registry: a refresh every PERIOD steps.


def step_seconds(step, state, batches) -> list[float]:
  """Each step's seconds, dispatched and waited for one at a time."""
  seconds = []
  for batch in batches:
    start = time.perf_counter()
    state, _ = step(state, batch)
    jax.block_until_ready(state)
    seconds.append(time.perf_counter() - start)
  return seconds


def update_gflop(tx, state, count: int) -> float:
  """GFLOP per device (XLA's count) of one update of ``state`` with its counts fixed at
  ``count``: a refresh count costs more than the next.

  Example:
      >>> import jax.numpy as jnp
      >>> from bv_sharding.optimizers import soap
      >>> tx, params = soap(1e-3), {"w": jnp.ones((64, 32))}
      >>> state = {"params": params, "opt": tx.init(params)}
      >>> update_gflop(tx, state, 10) > update_gflop(tx, state, 11) > 0
      True
  """
  fixed = lambda opt: optax.tree_utils.tree_set(opt, count=jax.numpy.asarray(count, "int32"))
  update = lambda grads, opt, params: tx.update(grads, fixed(opt), params)
  compiled = jax.jit(update).lower(state["params"], state["opt"], state["params"]).compile()
  return float(compiled.cost_analysis().get("flops", 0.0)) / 1e9


def measure(size: str, cycles: int) -> dict:
  """Per optimizer (soap, adamw) of ``size``: each step's seconds and its run's figures."""
  runs = {}
  for name in ("soap", "adamw"):
    config = lm_config(size, name)
    mesh, run, step, batches = setup(config, SETTLE + cycles * PERIOD)
    with jax.set_mesh(mesh), nn.logical_axis_rules(config.sharding_rules):
      state = init_state(run)
      flops = [update_gflop(run.tx, state, count) for count in (PERIOD, PERIOD + 1)]
      total = float(step.train.cost_analysis().get("flops", 0.0)) / 1e9
    runs[name] = dict(mesh=mesh, config=config, step=step.train, state=state, batches=batches)
    runs[name].update(update=flops, total=total)
  for r in runs.values():
    with jax.set_mesh(r["mesh"]), nn.logical_axis_rules(r["config"].sharding_rules):
      r["seconds"] = step_seconds(r["step"], r["state"], r["batches"])
  return runs


def row(size: str, runs: dict) -> str:
  """One table row (see the module docstring)."""
  soap, adamw = runs["soap"], runs["adamw"]
  timed = list(enumerate(soap["seconds"]))[SETTLE:]
  ms = lambda xs: 1e3 * statistics.median(xs)
  refresh = ms([s for count, s in timed if count % PERIOD == 0])
  other = ms([s for count, s in timed if count % PERIOD])
  amortised = (refresh + (PERIOD - 1) * other) / PERIOD
  base = ms(adamw["seconds"][SETTLE:])
  model = adamw["total"] - adamw["update"][1]
  return (
      f"| {size} | {refresh:.0f} | {other:.0f} | {amortised:.0f} | {base:.0f} | "
      f"{refresh / base:.2f} | {other / base:.2f} | {amortised / base:.2f} | "
      f"{soap['update'][0]:.2f} | {soap['update'][1]:.2f} | {adamw['update'][1]:.3f} | {model:.2f} |"
  )


@cli.command
def main(argv=None):
  parser = cli.Parser("python -m benchmarks.refresh_cost", __doc__)
  parser.add_argument("--sizes", default="tiny,small")
  parser.add_argument("--cycles", type=int, default=2, help="refresh periods timed per run")
  args = parser.parse_args(argv)
  jax.config.update("jax_num_cpu_devices", 8)
  print(
      "| size | soap refresh ms | soap other ms | soap amortised ms | adamw ms | refresh x adamw "
      "| other x adamw | amortised x adamw | update GFLOP refresh | update GFLOP other "
      "| adamw update GFLOP | fwd+bwd GFLOP |"
  )
  print("|---|---|---|---|---|---|---|---|---|---|---|---|")
  for size in args.sizes.split(","):
    print(row(size, measure(size, args.cycles)), flush=True)


if __name__ == "__main__":
  main()
