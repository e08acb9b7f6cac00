"""Train-step throughput on 8 simulated CPU devices: the config's sharding plan vs replication.

  python -m benchmarks.throughput [--sizes tiny,small] [--optimizers adamw,kron] [--steps 10] \
      [--turns 3]

For each model size and optimizer, the trainer's run of ``configs/lm.py``
(``trainers/build.py``: the config's whole optimizer section, its plan, its compiled
train step) runs twice: as configured, and as plain data parallelism
(:func:`replicated_run`): ``config.sharding_strategy = [(".*", "replicate()")]`` for every
param and state leaf, and the optimizer built without the params' layout, so no device
owns a matrix (Muon), a dealt block or a pool of tiles (Kron, Shampoo): every device does
every block's work on the whole state. The tiles, and so the math, are the same in both
(they do not depend on the mesh). The batch is split over "data" in both. Compilation
and two warm-up steps are excluded; the two take turns (``--turns``) and the fastest turn of
each is kept. Prints a markdown table.
"""

import os

from trainers import ONE_BLAS_THREAD

os.environ.setdefault(*ONE_BLAS_THREAD)

import dataclasses
import itertools

import flax.linen as nn
import jax

import bv_sharding as bvs
from benchmarks.timing import WARMUP, seconds_per_step
from configs import lm
from trainers import build, optimizers, steps
from trainers.input import batching
from trainers.settings import cli

REPLICATED = ((".*", "replicate()"),)


def replicated_run(config, mesh) -> build.Run:
  """``config``'s run as plain data parallelism on ``mesh``: every param and state leaf
  replicated, the optimizer built without a layout (every device computes every block).

  Example: ``replicated_run(lm_config("tiny", "muon"), mesh).plan.specs["opt"]`` (all ``P()``).
  """
  config = config.copy_and_resolve_references()
  config.sharding_strategy = REPLICATED
  run = build.build(config, mesh)
  tx, _ = build.optimizer(config)
  rules = config.sharding_rules
  params = bvs.plan({"params": jax.eval_shape(run.init)}, REPLICATED, mesh, rules=rules)
  plan = bvs.plan(steps.abstract_state(run.init, tx), REPLICATED, mesh, rules=rules, params=params)
  return dataclasses.replace(run, tx=tx, plan=plan, layout=None)


def setup(config, num_batches: int, replicated: bool = False) -> tuple:
  """``(mesh, run, step, batches)`` of ``config``'s run on this host's devices.

  ``run`` is the :class:`trainers.build.Run` (:func:`replicated_run` if ``replicated``),
  ``step`` its :class:`trainers.build.Step` (the trainer's compiled step); ``batches`` are
  ``num_batches`` global batches.
  """
  mesh = bvs.make_mesh(config.mesh, axis_types=build.axis_types(config))
  run = replicated_run(config, mesh) if replicated else build.build(config, mesh)
  step = build.compile_step(run)
  local = run.task.batches(run.task.train, global_batch=config.batch_size, seed=0)
  batches = [
      batching.to_global(b, step.batch_sharding) for b in itertools.islice(local, num_batches)
  ]
  return mesh, run, step, batches


def init_state(run) -> dict:
  """``run``'s born-sharded state (under ``jax.set_mesh`` of its mesh)."""
  return steps.init_state(run.init, run.tx, run.plan)


def compiled_step(config, num_steps: int, replicated: bool = False) -> tuple:
  """``(mesh, compiled step, state, batches, FLOPs per device per step)`` of ``config``'s
  train step (:func:`setup`'s ``replicated``); the FLOPs are XLA's count of the compiled
  step that is timed."""
  mesh, run, step, batches = setup(config, WARMUP + num_steps, replicated)
  with jax.set_mesh(mesh), nn.logical_axis_rules(config.sharding_rules):
    state = init_state(run)
  return mesh, step.train, state, batches, float(step.train.cost_analysis().get("flops", 0.0))


def fastest_rates(config, num_steps: int, turns: int) -> dict[bool, tuple[float, float]]:
  """``{replicated: (steps per second, FLOPs per device per step)}`` of ``config``'s step as
  planned (False) and replicated (True): the fastest of ``turns`` turns, the two taking
  turns so that a busy spell of the host slows both."""
  runs = {r: list(compiled_step(config, num_steps, r)) for r in (False, True)}
  best = dict.fromkeys(runs, float("inf"))
  for _ in range(turns):
    for replicated, run in runs.items():
      mesh, compiled, state, batches, _ = run
      with jax.set_mesh(mesh), nn.logical_axis_rules(config.sharding_rules):
        run[2], seconds = seconds_per_step(compiled, state, batches, num_steps)
      best[replicated] = min(best[replicated], seconds)
  return {r: (1 / best[r], runs[r][4]) for r in runs}


def lm_config(size: str, optimizer: str):
  """configs/lm.py of ``size`` with ``optimizer``, batch 16."""
  config = lm.get_config(f"size={size}")
  config.batch_size, config.optax_name = 16, optimizer
  return config


@cli.command
def main(argv=None):
  parser = cli.Parser("python -m benchmarks.throughput", __doc__)
  parser.add_argument("--sizes", default="tiny,small")
  parser.add_argument("--optimizers", default=",".join(optimizers.OPTIMIZERS))
  parser.add_argument("--steps", type=int, default=10, help="timed steps per turn")
  parser.add_argument("--turns", type=int, default=3, help="turns of each column, fastest kept")
  args = parser.parse_args(argv)
  jax.config.update("jax_num_cpu_devices", 8)
  print(
      f"{jax.device_count()} {jax.devices()[0].platform} devices, fastest of {args.turns} turns "
      f"of {args.steps} timed steps after {WARMUP} warm-up; batch split over 'data' in both "
      "columns\n"
  )
  print(
      "| size | optimizer | plan steps/s | replicated steps/s | plan / replicated "
      "| GFLOP/device plan | GFLOP/device replicated |"
  )
  print("|---|---|---|---|---|---|---|")
  for size, optimizer in itertools.product(args.sizes.split(","), args.optimizers.split(",")):
    rates = fastest_rates(lm_config(size, optimizer), args.steps, args.turns)
    (planned, planned_flops), (replicated, replicated_flops) = rates[False], rates[True]
    print(
        f"| {size} | {optimizer} | {planned:.2f} | {replicated:.2f} | {planned / replicated:.2f} "
        f"| {planned_flops / 1e9:.3f} | {replicated_flops / 1e9:.3f} |",
        flush=True,
    )


if __name__ == "__main__":
  main()
