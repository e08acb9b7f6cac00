"""Train-step throughput on 8 simulated CPU devices: the config's sharding plan vs replication.

  python -m benchmarks.throughput [--sizes tiny,small] [--optimizers adamw,kron] [--steps 10]

For each model size and optimizer, the same jitted train step (``trainers/steps.py``)
runs with the state planned by ``configs/lm.py``'s strategy and with the state fully
replicated (plain data parallelism); the batch is split over "data" in both.
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
from trainers.input import batching, tasks


def setup(config, strategy, optimizer: str, num_batches: int) -> tuple:
  """``(mesh, init, train_step, batches)`` of ``config``'s LM with the state planned by ``strategy``.

  ``init()`` (called under ``jax.set_mesh(mesh)``) returns the born-sharded state;
  ``batches`` are ``num_batches`` global batches.
  """
  mesh = bvs.make_mesh(config.mesh)
  sharding = steps.batch_sharding(mesh, steps.data_axes(mesh, config.sharding_rules))
  task = tasks.get_task(config)
  local = list(
      itertools.islice(
          task.batches(task.train, global_batch=config.batch_size, seed=0), num_batches
      )
  )
  model, init = build.model_and_init(config, build.example_input(task, local[0]))
  loss_fn = build.loss_fn(task, model)
  # Kron/Shampoo/Muon: shard-local blocks from the params' plan, as the trainer builds them.
  layout = build.param_layout(config.copy_and_resolve_references(), init, mesh)
  tx = optimizers.make_optimizer(optimizer, config.lr, layout=layout)
  plan = bvs.plan(steps.abstract_state(init, tx), strategy, mesh, rules=config.sharding_rules)
  batches = [batching.to_global(b, sharding) for b in local]
  train_step = steps.make_train_step(loss_fn, tx, plan, sharding)
  return mesh, lambda: steps.init_state(init, tx, plan), train_step, batches


def steps_per_sec(config, strategy: str, optimizer: str, num_steps: int) -> float:
  """Steps per second of ``config``'s train step with the state planned by ``strategy``."""
  mesh, init, train_step, batches = setup(config, strategy, optimizer, WARMUP + num_steps)
  with jax.set_mesh(mesh), nn.logical_axis_rules(config.sharding_rules):
    _, seconds = seconds_per_step(train_step, init(), batches, num_steps)
  return 1 / seconds


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
    config = lm.get_config(f"size={size}")
    config.batch_size = 16
    planned_rate = steps_per_sec(config, list(config.sharding_strategy), optimizer, args.steps)
    replicated_rate = steps_per_sec(config, "replicate()", optimizer, args.steps)
    print(
        f"| {size} | {optimizer} | {planned_rate:.2f} | {replicated_rate:.2f} | "
        f"{planned_rate / replicated_rate:.2f} |",
        flush=True,
    )


if __name__ == "__main__":
  main()
