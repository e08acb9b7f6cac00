r"""Trains a model with params and optimizer state sharded by one `config.sharding_strategy`.

  python -m trainers.train --config configs/lm.py --workdir /tmp/lm
  python -m trainers.train --config configs/lm.py:size=small --workdir /tmp/lm \
      --config.optax_name=kron --config.total_steps=500
  python -m trainers.launch --processes 2 --devices-per-process 4 -- \
      --config configs/lm.py --workdir /tmp/lm2      # 2 jax.distributed processes

Top to bottom: logging -> (jax.distributed) -> mesh -> data -> model -> optimizer
-> one sharding plan for {"params", "opt"} -> born-sharded init -> loop -> eval.
Bad configs raise `trainers.errors.ConfigError` (or `bvs.ShardingError`) naming the config key before anything is
allocated. Process 0 writes `workdir/config.json` and `workdir/metrics.jsonl`.

On CPU every process simulates `--devices_per_process` devices (default 8);
`--coordinator_address/--num_processes/--process_id` (or BV_COORDINATOR,
BV_NUM_PROCESSES, BV_PROCESS_ID) start jax.distributed.
"""

import os

# OpenBLAS threads fight XLA's on small hosts; set before numpy loads it.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import itertools
import json
import time

import flax.linen as nn
import jax
import numpy as np
from absl import app, flags, logging
from ml_collections import config_flags

import bv_sharding as bvs
from trainers import data, models, optimizers, steps, tasks

_CONFIG = config_flags.DEFINE_config_file("config", None, "Training config file.", lock_config=True)
_WORKDIR = flags.DEFINE_string(
    "workdir", None, "Where config.json and metrics.jsonl go.", required=True
)
_COORDINATOR = flags.DEFINE_string(
    "coordinator_address",
    os.environ.get("BV_COORDINATOR"),
    "host:port of process 0; starts jax.distributed.",
)
_NUM_PROCESSES = flags.DEFINE_integer(
    "num_processes",
    int(os.environ.get("BV_NUM_PROCESSES", 1)),
    "Number of jax.distributed processes.",
)
_PROCESS_ID = flags.DEFINE_integer(
    "process_id",
    int(os.environ.get("BV_PROCESS_ID", 0)),
    "This process's id in [0, num_processes).",
)
_DEVICES = flags.DEFINE_integer(
    "devices_per_process",
    int(os.environ.get("BV_DEVICES_PER_PROCESS", 8)),
    "Simulated devices per process on the CPU backend "
    "(jax_num_cpu_devices); GPU/TPU backends ignore it.",
)


def main(argv):
  del argv
  config = _CONFIG.value
  # Both must happen before anything starts the backend.
  jax.config.update("jax_num_cpu_devices", _DEVICES.value)
  if _COORDINATOR.value:
    jax.distributed.initialize(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
  lead = jax.process_index() == 0
  metrics_path = os.path.join(_WORKDIR.value, "metrics.jsonl")
  if lead:
    os.makedirs(_WORKDIR.value, exist_ok=True)
    with open(os.path.join(_WORKDIR.value, "config.json"), "w") as f:
      f.write(config.to_json_best_effort(indent=2))
    open(metrics_path, "w").close()
  logging.info(
      "process %d of %d, %d devices (%d here)",
      jax.process_index(),
      jax.process_count(),
      jax.device_count(),
      jax.local_device_count(),
  )

  mesh = bvs.make_mesh(config.mesh)
  data_axes = steps.data_axes(mesh, config.sharding_rules, config.data_axes)
  steps.check_batch_size(config.batch_size, mesh, data_axes, jax.process_count())
  batch_sharding = steps.batch_sharding(mesh, data_axes)
  logging.info("mesh %s, batch split over %s", dict(mesh.shape), data_axes)

  task = tasks.get_task(config)
  train_batches = task.batches(task.train, global_batch=config.batch_size, seed=config.seed)
  eval_batches = list(
      itertools.islice(  # Same held-out rows at every eval.
          task.batches(task.held_out, global_batch=config.batch_size, seed=config.seed + 1),
          config.eval_batches,
      )
  )

  model = models.get_model(config.model_name, **config.model.to_dict())
  example = task.inputs(jax.tree.map(lambda x: x[:1], eval_batches[0]))
  init = lambda: model.init(jax.random.key(config.seed), example)["params"]

  def loss_fn(params, batch):
    return task.loss(model.apply({"params": params}, task.inputs(batch)), batch)

  schedule = (
      None
      if config.schedule is None
      else {"total_steps": config.total_steps, **config.schedule.to_dict()}
  )
  # The params' plan first: Kron and Shampoo cut their blocks inside each device's shard.
  params_plan = bvs.plan(
      {"params": jax.eval_shape(init)}, config.sharding_strategy, mesh, rules=config.sharding_rules
  )
  try:
    tx = optimizers.make_optimizer(
        config.optax_name,
        config.lr,
        schedule=schedule,
        weight_decay=config.wd,
        clip_norm=config.grad_clip_norm,
        layout=optimizers.ParamLayout.from_plan(params_plan),
        **config.optax.to_dict(),
    )
  except optimizers.OptimizerError as e:
    raise optimizers.OptimizerError(f"config.optax_name / config.optax: {e}") from None
  lr = optimizers.make_schedule(config.lr, **schedule) if schedule else lambda _: config.lr

  plan = bvs.plan(
      steps.abstract_state(init, tx), config.sharding_strategy, mesh, rules=config.sharding_rules
  )
  if lead:
    logging.info("sharding plan:\n%s", plan.report())
  train_step = steps.make_train_step(loss_fn, tx, plan, batch_sharding)
  eval_step = steps.make_eval_step(loss_fn, plan, batch_sharding)

  def evaluate(params):
    return float(
        np.mean([eval_step(params, data.to_global(b, batch_sharding)) for b in eval_batches])
    )

  with jax.set_mesh(mesh), nn.logical_axis_rules(config.sharding_rules):
    logging.info("initialising params and optimizer state in their planned shardings")
    state = steps.init_state(init, tx, plan)
    steps.check_state(plan, state, "after init")
    logging.info("state shardings match the plan after init")

    total, tick, tick_step = config.total_steps, time.perf_counter(), 0
    for step, batch in zip(range(1, total + 1), train_batches):
      state, loss = train_step(state, data.to_global(batch, batch_sharding))
      if step == 1:
        steps.check_state(plan, state, "after the first step")
        logging.info("state shardings match the plan after the first step")
      is_eval = step % config.eval_every == 0 or step == total
      if not (is_eval or step == 1 or step % config.log_every == 0):
        continue
      record = {"step": step, "loss": float(loss), "lr": float(lr(step - 1))}
      record["steps_per_sec"] = (step - tick_step) / (time.perf_counter() - tick)
      per_sec = record["steps_per_sec"] * config.batch_size * task.per_example
      line = (
          f"step {step}/{total} loss={record['loss']:.4f} "
          f"steps/s={record['steps_per_sec']:.2f} {task.unit}/s={per_sec:.0f}"
      )
      if is_eval:
        record["eval_loss"] = evaluate(state["params"])
        line += f" eval_loss={record['eval_loss']:.4f}"
      logging.info("%s", line)
      if lead:
        with open(metrics_path, "a") as f:
          f.write(json.dumps(record) + "\n")
      tick, tick_step = time.perf_counter(), step


if __name__ == "__main__":
  app.run(main)
