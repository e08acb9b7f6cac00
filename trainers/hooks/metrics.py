"""The loop's "metrics" hook: a line and a record per logged step, to metrics.jsonl and TensorBoard.

A :class:`StepLog` gets each step's metrics as the loop reads them (``Hook.read``), in step
order; at the steps :func:`logs_step` picks (step 1, every ``config.log_every`` steps, every
eval) it logs a line and gives ``write`` a record: the step's metrics, its learning rates,
speed, FLOPs and MFU, the eval loss at evals. The trainer's ``write`` is
``fan_out(metrics_writer, event_writer)`` (``workdir/metrics.jsonl`` and
``workdir/tensorboard/``: trainers/rundir/workdir.py, events.py), process 0's only; the
command hangs it on the loop with the log period, so the loop reads the metrics there::

  log = StepLog(config, task, learning_rates, start, evaluate, fan_out(metrics, curves), cost)
  loop.add_hook(name="metrics", every=config.log_every, read=log)

Example:
  >>> import ml_collections
  >>> config = ml_collections.ConfigDict(dict(log_every=10, eval_every=25, total_steps=30))
  >>> [step for step in range(1, 31) if logs_step(step, config)[0]]
  [1, 10, 20, 25, 30]
  >>> import types
  >>> records = []
  >>> fan_out(types.SimpleNamespace(write=records.append))({"step": 1})
  >>> records
  [{'step': 1}]
"""

import math
import time
from collections.abc import Callable

import jax
from absl import logging

from bv_sharding.optimizers import ramp
from trainers.figures import utilization
from trainers.settings import schema


def logs_step(step: int, config) -> tuple[bool, bool]:
  """(whether ``step`` is logged, whether it is evaluated).

  Logged: step 1, every ``config.log_every`` steps and every eval; evaluated: every
  ``config.eval_every`` steps and the last.

  Example:
    >>> import ml_collections
    >>> config = ml_collections.ConfigDict(dict(log_every=10, eval_every=25, total_steps=30))
    >>> [step for step in range(1, 31) if logs_step(step, config)[1]]
    [25, 30]
  """
  is_eval = step % config.eval_every == 0 or step == config.total_steps
  return is_eval or step == 1 or step % config.log_every == 0, is_eval


class StepLog:
  """Logs a line, and gives ``write`` a metrics record, at the steps :func:`logs_step` picks.

  A record holds the step, the step's metrics (loss, ``l2_grads``, ``l2_params``,
  ``l2_updates``), each learning rate applied at that step, the steps per second since the
  last record, the ``cost``'s ``flops_per_step`` and ``flops_source``, per device
  ``<unit>_per_sec`` (``tokens_per_sec``, ``images_per_sec``) and ``tflops_per_device``,
  ``mfu`` (null where the device's peak is unknown) and, at evals, ``eval_loss``
  (``evaluate(params)``) and, where the data's bytes per token are known (text: 1; token
  files: their records), ``eval_bits_per_byte`` = eval_loss / ln 2 / bytes per token, which
  compares runs across tokenizers. ``start`` is where the run starts
  (``trainers.start.Start``: its ``step`` and ``opt_start``).
  """

  def __init__(
      self,
      config,
      task,
      learning_rates,
      start,
      evaluate,
      write,
      cost: utilization.StepCost,
  ):
    self.config, self.task, self.cost = schema.of(config), task, cost
    self.learning_rates, self.opt_start = learning_rates, start.opt_start
    self.evaluate, self.write = evaluate, write
    self.tick, self.tick_step = time.perf_counter(), start.step

  def __call__(self, step: int, metrics: dict, params) -> None:
    logged, is_eval = logs_step(step, self.config)
    if not logged:
      return
    record = {"step": step, **metrics}  # metrics start with the loss.
    # The schedules count global steps; an optimizer born mid-run is ramped in (rebirth.py).
    scale = ramp(self.config.rewarmup_steps, step - 1 - self.opt_start)
    scale = scale if self.opt_start else 1.0
    record.update({k: float(lr(step - 1)) * scale for k, lr in self.learning_rates.items()})
    record["steps_per_sec"] = (step - self.tick_step) / (time.perf_counter() - self.tick)
    per_step = self.config.batch_size * self.task.per_example
    record.update(self.cost.record(record["steps_per_sec"], per_step, self.task.unit))
    mfu = "null" if record["mfu"] is None else f"{record['mfu']:.1%}"
    line = (
        f"step {step}/{self.config.total_steps} loss={record['loss']:.4f} "
        f"l2_grads={record['l2_grads']:.3g} steps/s={record['steps_per_sec']:.2f} "
        f"{self.task.unit}/s/device={record[self.task.unit + '_per_sec']:.0f} "
        f"TFLOP/s/device={record['tflops_per_device']:.3g} MFU={mfu}"
    )
    if is_eval:
      record["eval_loss"] = self.evaluate(params)
      line += f" eval_loss={record['eval_loss']:.4f}"
      if self.task.bytes_per_token:
        bits = record["eval_loss"] / math.log(2) / self.task.bytes_per_token
        record["eval_bits_per_byte"] = bits
        line += f" eval_bits_per_byte={bits:.4f}"
    logging.info("%s", line)
    if self.write is not None:
      self.write(record)
    self.tick, self.tick_step = time.perf_counter(), step


def fan_out(*writers) -> Callable[[dict], None]:
  """One ``write(record)`` that gives the record to each writer's ``write``, in order.

  Example: ``StepLog(..., write=fan_out(metrics, curves), ...)``.
  """

  def write(record: dict) -> None:
    for writer in writers:
      writer.write(record)

  return write


def step_cost(run, batch_sharding) -> utilization.StepCost:
  """The step's model FLOPs, traced (else the 6·N·tokens + attention formula), and this
  device's peak (:func:`utilization.step_cost`), logged; ``run``: a ``trainers.build.Run``.

  Example: ``StepLog(config, task, lrs, start, evaluate, write, step_cost(run, sharding))``.
  """
  cost = utilization.step_cost(run, run.config, batch_sharding, run.batch_shapes)
  logging.info(
      "train step: %.4g model FLOPs (%s), %s peak bf16 FLOP/s %s",
      cost.flops,
      cost.source,
      jax.devices()[0].device_kind,
      "unknown (MFU null)" if cost.peak is None else f"{cost.peak:.4g}",
  )
  return cost
