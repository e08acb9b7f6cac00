"""A refresh or fit step against the other steps, and amortised: SOAP, Kron and Shampoo.

  python -m benchmarks.refresh_cost [--sizes tiny,small] [--optimizers soap,kron,shampoo] \
      [--cycles 2]

Each of these optimizers does its costly work on some steps only, under ``lax.cond``: SOAP
refreshes its bases (a power iteration and a QR per block) every ``precondition_frequency``
(10) steps, Kron fits Q on its update steps (here every 10th: ``preconditioner_update_probability``
0.1, the schedule's floor is 0.03), Shampoo refreshes its roots (``eigh``) every
``update_preconditioners_freq`` steps (here 10, the registry's default, every tile on one
step: ``refresh_groups=1``, where the default refreshes a tenth of them each step). Kron's
and Shampoo's pools also move the fit's inputs in, and the new factors back, only then.

For each size of ``configs/lm.py`` (batch 16, 8 simulated devices) the trainer's compiled
step runs with each optimizer, then with ``adamw``, each step timed alone (dispatched and
waited for): a row gives the median milliseconds of the refresh (or fit) steps, of the other
steps (the first two of each run left out: they compile and settle), their mean over one
period (the amortised step), and adamw's median in the same run, with the ratios. The update's
GFLOP per device are XLA's count (``cost_analysis``) of the optimizer update alone, compiled
with its counters fixed at a refresh step and at another one; LAPACK's QR, ``eigh`` and
triangular solves are calls XLA does not count, so these are the matmuls around them. XLA's
count barely tells the two apart on the trainer's step (Kron's is the same at both,
docs/benchmarks.md): the milliseconds are the measure. The forward and backward pass's GFLOP per device (the adamw
step's count less its update's) are beside them.
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
from bv_sharding.optimizers import skipping
from trainers.settings import cli

SETTLE = 2  # Steps of each run left out of the medians (compile, then caches).
PERIOD = 10  # A refresh or fit every PERIOD steps.
# optimizer -> (its config.optax settings for a refresh or fit every PERIOD steps, whether step
# i (of a run from count 0) is one, its state's counters fixed at such a step and at another).
PERIODIC = {
    "soap": ({}, lambda i: i > 0 and i % PERIOD == 0, ({"count": PERIOD}, {"count": PERIOD + 1})),
    "kron": (
        {"preconditioner_update_probability": 1 / PERIOD},
        lambda i: i % PERIOD == PERIOD - 1,  # Its counter reaches 1 / probability.
        ({"update_counter": PERIOD - 1}, {"update_counter": 0}),
    ),
    "shampoo": (
        {"update_preconditioners_freq": PERIOD, "refresh_groups": 1},
        lambda i: i % PERIOD == 0,
        ({"count": PERIOD}, {"count": PERIOD + 1}),
    ),
}


def step_seconds(step, state, batches) -> list[float]:
  """Each step's seconds, dispatched and waited for one at a time."""
  seconds = []
  for batch in batches:
    start = time.perf_counter()
    state, _ = step(state, batch)
    jax.block_until_ready(state)
    seconds.append(time.perf_counter() - start)
  return seconds


def update_gflop(tx, state, counters: dict) -> float:
  """GFLOP per device (XLA's count) of one update of ``state`` with the state fields named in
  ``counters`` fixed at their values, compiled as an accelerator runs it (the work a step may
  skip under ``lax.cond``: ``bv_sharding.optimizers.skipping``): a refresh count costs more
  than the next.

  Example:
      >>> import jax.numpy as jnp
      >>> from bv_sharding.optimizers import soap
      >>> tx = soap(1e-3, power_damping=0.0)  # Bases refitted by eigh every 10 steps.
      >>> params = {"w": jnp.ones((64, 32))}
      >>> state = {"params": params, "opt": tx.init(params)}
      >>> update_gflop(tx, state, {"count": 10}) > update_gflop(tx, state, {"count": 11}) > 0
      True
  """
  fixed = {k: jax.numpy.asarray(v, "int32") for k, v in counters.items()}
  update = lambda grads, opt, params: tx.update(
      grads, optax.tree_utils.tree_set(opt, **fixed), params
  )
  with skipping(True):
    lowered = jax.jit(update).lower(state["params"], state["opt"], state["params"])
  compiled = lowered.compile()
  return float(compiled.cost_analysis().get("flops", 0.0)) / 1e9


def measure(size: str, optimizers: list[str], cycles: int) -> dict:
  """Per optimizer of ``size`` (``optimizers`` and adamw): each step's seconds and its run's
  figures (adamw's update at its counts after one period)."""
  runs = {}
  for name in [*optimizers, "adamw"]:
    settings, _, counters = PERIODIC.get(name, ({}, None, ({"count": PERIOD + 1},) * 2))
    config = lm_config(size, name)
    config.optax.update(settings)
    mesh, run, step, batches = setup(config, SETTLE + cycles * PERIOD)
    with jax.set_mesh(mesh), nn.logical_axis_rules(config.sharding_rules):
      state = init_state(run)
      flops = [update_gflop(run.tx, state, fixed) for fixed in counters]
      total = float(step.train.cost_analysis().get("flops", 0.0)) / 1e9
    runs[name] = dict(mesh=mesh, config=config, step=step.train, state=state, batches=batches)
    runs[name].update(update=flops, total=total)
  for r in runs.values():
    with jax.set_mesh(r["mesh"]), nn.logical_axis_rules(r["config"].sharding_rules):
      r["seconds"] = step_seconds(r["step"], r["state"], r["batches"])
  return runs


def row(size: str, name: str, runs: dict) -> str:
  """One table row (see the module docstring)."""
  ours, adamw, refreshes = runs[name], runs["adamw"], PERIODIC[name][1]
  timed = list(enumerate(ours["seconds"]))[SETTLE:]
  ms = lambda xs: 1e3 * statistics.median(xs)
  refresh = ms([s for i, s in timed if refreshes(i)])
  other = ms([s for i, s in timed if not refreshes(i)])
  amortised = (refresh + (PERIOD - 1) * other) / PERIOD
  base = ms(adamw["seconds"][SETTLE:])
  model = adamw["total"] - adamw["update"][1]
  return (
      f"| {size} | {name} | {refresh:.0f} | {other:.0f} | {amortised:.0f} | {base:.0f} | "
      f"{refresh / base:.2f} | {other / base:.2f} | {amortised / base:.2f} | "
      f"{ours['update'][0]:.2f} | {ours['update'][1]:.2f} | {adamw['update'][1]:.3f} | {model:.2f} |"
  )


@cli.command
def main(argv=None):
  parser = cli.Parser("python -m benchmarks.refresh_cost", __doc__)
  parser.add_argument("--sizes", default="tiny,small")
  parser.add_argument("--optimizers", default=",".join(PERIODIC))
  parser.add_argument("--cycles", type=int, default=2, help="refresh periods timed per run")
  args = parser.parse_args(argv)
  jax.config.update("jax_num_cpu_devices", 8)
  print(
      "| size | optimizer | refresh ms | other ms | amortised ms | adamw ms | refresh x adamw "
      "| other x adamw | amortised x adamw | update GFLOP refresh | update GFLOP other "
      "| adamw update GFLOP | fwd+bwd GFLOP |"
  )
  print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
  optimizers = args.optimizers.split(",")
  for size in args.sizes.split(","):
    runs = measure(size, optimizers, args.cycles)
    for name in optimizers:
      print(row(size, name, runs), flush=True)


if __name__ == "__main__":
  main()
