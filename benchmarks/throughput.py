"""Train-step throughput on 8 simulated CPU devices: the config's sharding plan vs replication.

  python benchmarks/throughput.py [--sizes tiny,small] [--optimizers adamw,kron] [--steps 10]

For each model size and optimizer, the same jitted train step (trainers/steps.py)
runs with the state planned by configs/lm.py's strategy and with the state fully
replicated (plain data parallelism); the batch is split over "data" in both.
Compilation and two warm-up steps are excluded. Prints a markdown table.
"""

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse
import itertools
import time

import flax.linen as nn
import jax

import bv_sharding as bvs
from configs import lm
from trainers import data, models, optimizers, steps, tasks

WARMUP = 2


def steps_per_sec(config, strategy: str, optimizer: str, num_steps: int) -> float:
  """Steps per second of `config`'s train step with the state planned by `strategy`."""
  mesh = bvs.make_mesh(config.mesh)
  sharding = steps.batch_sharding(mesh, steps.data_axes(mesh, config.sharding_rules))
  task = tasks.get_task(config)
  model = models.get_model(config.model_name, **config.model.to_dict())
  local = list(
      itertools.islice(
          task.batches(task.train, global_batch=config.batch_size, seed=0), WARMUP + num_steps
      )
  )
  init = lambda: model.init(jax.random.key(0), task.inputs(local[0][:1]))["params"]
  loss_fn = lambda p, b: task.loss(model.apply({"params": p}, task.inputs(b)), b)
  params_plan = bvs.plan(
      {"params": jax.eval_shape(init)}, strategy, mesh, rules=config.sharding_rules
  )
  layout = optimizers.ParamLayout.from_plan(params_plan)  # Kron/Shampoo: shard-local blocks
  tx = optimizers.make_optimizer(optimizer, config.lr, layout=layout)
  plan = bvs.plan(steps.abstract_state(init, tx), strategy, mesh, rules=config.sharding_rules)
  batches = [data.to_global(b, sharding) for b in local]
  with jax.set_mesh(mesh), nn.logical_axis_rules(config.sharding_rules):
    state = steps.init_state(init, tx, plan)
    train_step = steps.make_train_step(loss_fn, tx, plan, sharding)
    for batch in batches[:WARMUP]:
      state, loss = train_step(state, batch)
    jax.block_until_ready(loss)
    start = time.perf_counter()
    for batch in batches[WARMUP:]:
      state, loss = train_step(state, batch)
    jax.block_until_ready(loss)
  return num_steps / (time.perf_counter() - start)


def main():
  parser = argparse.ArgumentParser(
      description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument("--sizes", default="tiny,small")
  parser.add_argument("--optimizers", default=",".join(optimizers.OPTIMIZERS))
  parser.add_argument("--steps", type=int, default=10, help="timed steps per measurement")
  args = parser.parse_args()
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
    (planned,) = config.sharding_strategy
    planned = steps_per_sec(config, [planned], optimizer, args.steps)
    replicated = steps_per_sec(config, "replicate()", optimizer, args.steps)
    print(
        f"| {size} | {optimizer} | {planned:.2f} | {replicated:.2f} | "
        f"{planned / replicated:.2f} |",
        flush=True,
    )


if __name__ == "__main__":
  main()
