r"""Trains a model with params and optimizer state sharded by one ``config.sharding_strategy``.

  python -m trainers.train --config configs/lm.py --workdir /tmp/lm
  python -m trainers.train --config configs/lm.py:size=small --workdir /tmp/lm \
      --config.optax_name=kron --config.total_steps=500
  python -m trainers.launch --processes 2 --devices-per-process 4 -- \
      --config configs/lm.py --workdir /tmp/lm2      # 2 jax.distributed processes

Top to bottom: logging -> (jax.distributed) -> mesh -> data -> model -> optimizer
-> one sharding plan for {"params", "opt"} -> born-sharded init -> loop -> eval.
Every config value is checked first (trainers/validation.py), the memory the plan needs
before init; a bad one ends the run as one line, ``ConfigError: config.<key>=...``, before
the workdir is touched or anything allocated (``--debug`` for the traceback). Process 0 then
writes ``workdir/config.json`` and ``workdir/metrics.jsonl``; an earlier run's files there are
moved into ``workdir/attempt-N/`` (trainers/workdir.py). Every process saves orbax
checkpoints (every ``config.ckpt_steps``, at the end, on SIGTERM); a workdir holding one
resumes from it exactly (trainers/checkpoint.py). A NaN or infinite loss stops the run
(``config.on_nonfinite="stop"``) or skips the update ("skip"; trainers/divergence.py).

On CPU every process simulates ``--devices_per_process`` devices (default 8);
``--coordinator_address/--num_processes/--process_id`` (or BV_COORDINATOR,
BV_NUM_PROCESSES, BV_PROCESS_ID) start jax.distributed; without them a job jax
detects (TPU pod, SLURM, ...) starts it from the environment (``--nodistributed_auto``: off).
Before allocating, every process checks that all computed the same plan, and
``config.max_unsharded_fraction`` (if set) gates the plan's coverage.
"""

import os

from trainers.host import ONE_BLAS_THREAD

os.environ.setdefault(*ONE_BLAS_THREAD)  # Before numpy loads OpenBLAS (trainers/host.py).

import itertools
import time

import flax.linen as nn
import jax
import numpy as np
from absl import flags, logging
from ml_collections import config_flags

import bv_sharding as bvs
from trainers import (
    checkpoint,
    cli,
    components,
    data,
    distributed,
    divergence,
    prefetch,
    provenance,
    steps,
    tasks,
    validation,
    workdir,
)

_CONFIG = config_flags.DEFINE_config_file(
    cli.CONFIG_FLAG,
    None,
    "Training config file.",
    lock_config=False,  # cli.check_overrides rejects unknown keys; config.optax takes any.
    accept_new_attributes=True,
)
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
_AUTO = flags.DEFINE_bool(
    "distributed_auto",
    True,
    "Without --coordinator_address, start jax.distributed where jax detects a cluster "
    "(TPU pods, SLURM, Open MPI, Kubernetes); --nodistributed_auto for single-host runs.",
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
  validation.check_config(
      config,
      devices_per_process=_DEVICES.value,
      num_processes=_NUM_PROCESSES.value,
      process_id=_PROCESS_ID.value,
  )
  workdir.check(_WORKDIR.value)
  # Both must happen before anything starts the backend.
  jax.config.update("jax_num_cpu_devices", _DEVICES.value)
  how = distributed.start(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value, _AUTO.value)
  is_main_process = jax.process_index() == 0
  logging.info("jax.distributed: %s", how)
  logging.info(
      "process %d of %d, %d devices (%d here)",
      jax.process_index(),
      jax.process_count(),
      jax.device_count(),
      jax.local_device_count(),
  )

  mesh = bvs.make_mesh(config.mesh, dcn_mesh=config.get("dcn_mesh"))
  data_axes = steps.data_axes(mesh, config.sharding_rules, config.data_axes)
  steps.check_batch_size(config.batch_size, mesh, data_axes, jax.process_count())
  batch_sharding = steps.batch_sharding(mesh, data_axes)
  logging.info("mesh %s, batch split over %s", dict(mesh.shape), data_axes)

  task = tasks.get_task(config)
  eval_batches = list(
      itertools.islice(  # Same held-out rows at every eval.
          task.batches(task.held_out, global_batch=config.batch_size, seed=config.seed + 1),
          config.eval_batches,
      )
  )

  model, init = components.model_and_init(config, components.example_input(task, eval_batches[0]))
  task.check(model)  # Token ids / labels fit the model, before init.

  loss_fn = components.loss_fn(task, model)
  # big_vision's optimizer section or a project optimizer; the logged lr is the one it applies.
  # The params' plan first: Kron, Shampoo and Muon cut their blocks inside each device's shard.
  layout = components.param_layout(config, init, mesh)
  tx, learning_rates = components.optimizer(config, layout)

  plan = components.plan_state(config, init, tx, mesh)
  if is_main_process:
    logging.info("sharding plan:\n%s", plan.report())
  if config.get("max_unsharded_fraction") is not None:
    bvs.check_coverage(plan, config.max_unsharded_fraction)
  bvs.check_same_plan(plan)  # Before allocating: every process planned the same.
  logging.info("%s", validation.check_memory(plan, jax.local_devices()))
  train_step = steps.make_train_step(loss_fn, tx, plan, batch_sharding)
  eval_step = steps.make_eval_step(loss_fn, plan, batch_sharding)

  def evaluate(params):
    return float(
        np.mean([eval_step(params, data.to_global(b, batch_sharding)) for b in eval_batches])
    )

  # Every check passed: only now is the workdir touched.
  # A restore onto another mesh moves Kron's and Shampoo's block stacks to this layout.
  blocking = checkpoint.Blocking(layout, lambda other: components.optimizer(config, other)[0])
  ckpt = checkpoint.Checkpoints(_WORKDIR.value, config, blocking)
  if is_main_process:
    note = workdir.prepare(_WORKDIR.value, resuming=ckpt.latest_step() is not None)
    if note:
      logging.warning("%s", note)
  metrics = workdir.MetricsWriter(_WORKDIR.value)
  watch = divergence.LossWatch(
      config.get("on_nonfinite", "stop"),
      config.lr,
      write=metrics.write if is_main_process else None,
  )

  with jax.set_mesh(mesh), nn.logical_axis_rules(config.sharding_rules):
    logging.info("initialising params and optimizer state in their planned shardings")
    state, start = ckpt.restore_or_init(plan, tx, fresh=lambda: steps.init_state(init, tx, plan))
    when = "after init" if start.source == "scratch" else "after restore"
    steps.check_state(plan, state, when)
    logging.info("state shardings match the plan %s", when)
    if is_main_process:
      provenance.record_start(_WORKDIR.value, config, start.step, start.source)
      moved = workdir.keep_metrics_until(metrics.path, start.step)
      if moved:
        logging.info("metrics.jsonl lines after step %d moved to %s", start.step, moved)
    local_batches = task.batches(
        task.train, global_batch=config.batch_size, seed=config.seed, start_step=start.step
    )
    train_batches = prefetch.to_device(local_batches, batch_sharding, task.prefetch)

    total, tick, tick_step = config.total_steps, time.perf_counter(), start.step
    for step, batch in zip(range(start.step + 1, total + 1), train_batches):
      state, loss = train_step(state, batch)
      loss = float(loss)
      if not watch.observe(step, loss):  # Raises under "stop".
        logging.warning("step %d: loss %s, update skipped", step, loss)
      if step == start.step + 1:
        steps.check_state(plan, state, "after the first step")
        logging.info("state shardings match the plan after the first step")
      is_eval = step % config.eval_every == 0 or step == total
      if is_eval or step == 1 or step % config.log_every == 0:
        record = {"step": step, "loss": loss}
        record.update(
            {k: float(lr(step - 1 - start.opt_start)) for k, lr in learning_rates.items()}
        )
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
        if is_main_process:
          metrics.write(record)
        tick, tick_step = time.perf_counter(), step
      if ckpt.step_done(step, state):
        return  # SIGTERM: every process saved this step.
    ckpt.close(state)


if __name__ == "__main__":
  cli.run(main)
