"""The training loop: the device always has the next step queued while the host reads.

A :class:`Loop` dispatches a train step per ``(step, batch)`` pair and reads the step
metrics (loss, ``l2_grads``, ``l2_params``, ``l2_updates``) in one fetch per log step, once
the next step is queued (:class:`Pending`), checking each loss against the non-finite
policy in step order (``trainers/hooks/divergence.py``) and logging the steps :func:`logs_step`
picks (:class:`StepLog`). Everything else attaches as a named hook with a period,
``loop.add_hook(fn, every=N, name=...)``: ``fn(step, state)`` runs after every ``N``-th
step and the last one, in the order added, and returning True stops the loop. The trainer
(``trainers/train.py``) hangs on it the profile trace (``trainers/rundir/profiling.py``),
the eval (:meth:`Pending.evaluate`) and the checkpointer (:meth:`Loop.add_checkpointer`),
which saves every ``config.ckpt_steps``, at the end and on preemption
(``trainers/rundir/checkpoint.py``);
the accelerator benchmark runs the same loop with none of them.

Example:
  >>> import ml_collections
  >>> from trainers.hooks import divergence
  >>> config = ml_collections.ConfigDict(dict(log_every=2, eval_every=3, total_steps=4))
  >>> log = lambda step, metrics, params: print("read", step, params)
  >>> pending = Pending(divergence.LossWatch("stop", 0.1), log)
  >>> loop = Loop(lambda state, batch: (state + batch, {"loss": 1.0, "l2_params": 1.0}),
  ...             pending, plan=None, config=config)
  >>> loop.add_hook(lambda step, state: print("eval at", step), every=3, name="eval")
  >>> loop.run(0, zip(range(1, 5), [10, 20, 30, 40]))  # reads step 1 once step 2 is queued
  read 1 None
  read 2 None
  eval at 3
  read 3 None
  eval at 4
  read 4 None
  100
"""

import dataclasses
import math
import time
from collections.abc import Callable, Iterable
from typing import Any

import jax
import numpy as np
from absl import logging

from bv_sharding.optimizers import ramp
from trainers import steps
from trainers.figures import utilization
from trainers.hooks import divergence
from trainers.input import batching
from trainers.settings import schema


@dataclasses.dataclass(frozen=True)
class Hook:
  """What :meth:`Loop.add_hook` attaches: ``after(step, state)`` after every ``every``-th step
  and the last (True stops the loop), ``before(step)`` before each step is dispatched, and
  ``end(state)`` with the last state once the batches run out."""

  name: str
  after: Callable[[int, Any], bool | None]
  every: int = 1
  before: Callable[[int], None] | None = None
  end: Callable[[Any], None] | None = None


class Loop:
  """Takes a ``train_step`` per ``(step, batch)``; reads the metrics through ``pending``.

  ``plan``: the state's (its shardings are checked after the first step; None: not
  checked); ``config``: ``log_every``, ``eval_every`` and ``total_steps`` (:func:`logs_step`).
  A logged step's metrics are read once the next step is dispatched; a hook that needs a
  step's state (an eval, a save) reads them at once (:meth:`Pending.evaluate`,
  :meth:`Pending.settle`). See the module example.
  """

  def __init__(self, train_step: Callable, pending: "Pending", plan, config):
    self.train_step, self.pending, self.plan, self.config = train_step, pending, plan, config
    self.hooks: list[Hook] = []

  def add_hook(
      self,
      fn: Callable[[int, Any], bool | None],
      every: int = 1,
      name: str | None = None,
      before: Callable[[int], None] | None = None,
      end: Callable[[Any], None] | None = None,
  ) -> None:
    """Runs ``fn(step, state)`` after every ``every``-th step and the last (True: stop now);
    ``before(step)`` before each step, ``end(state)`` once the batches run out."""
    self.hooks.append(Hook(name or getattr(fn, "__name__", "hook"), fn, every, before, end))

  def add_checkpointer(self, ckpt) -> None:
    """Hangs ``ckpt`` (``checkpoint.Checkpoints``) on as the "checkpoint" hook: its
    ``step_done`` after every step (a save every ``config.ckpt_steps``; on preemption a save
    that stops the loop), its ``close`` at the end; each save settles the pending steps first
    (:meth:`Pending.settle`)."""
    settle = self.pending.settle
    self.add_hook(
        lambda step, state: ckpt.step_done(step, state, before_save=settle),
        name="checkpoint",
        end=lambda state: ckpt.close(state, before_save=settle),
    )

  def run(self, state, numbered_batches: Iterable[tuple[int, Any]]):
    """Takes a step per pair, then reads what is left and runs the hooks' ``end``; returns the
    last state (early, without ``end``, when a hook stops the loop: SIGTERM)."""
    read_next = False
    for i, (step, batch) in enumerate(numbered_batches):
      for hook in self.hooks:
        if hook.before:
          hook.before(step)
      state, metrics = self.train_step(state, batch)
      if read_next:
        self.pending.read()  # The steps before this one, now that it is queued.
      self.pending.add(step, metrics)
      if i == 0 and self.plan is not None:
        steps.check_state(self.plan, state, "after the first step")
        logging.info("state shardings match the plan after the first step")
      read_next = logs_step(step, self.config)[0]
      if self.after(step, state):
        return state  # A hook stopped the run (SIGTERM: every process saved this step).
    self.pending.read()
    for hook in self.hooks:
      if hook.end:
        hook.end(state)
    return state

  def after(self, step: int, state) -> bool:
    """Runs the hooks due after ``step`` (every ``hook.every`` steps and the last), in order,
    until one says stop; True if one did."""
    for hook in self.hooks:
      if (step % hook.every == 0 or step == self.config.total_steps) and hook.after(step, state):
        return True
    return False


class Pending:
  """The train step's metrics, left on the device until the loop reads them, in step order.

  :meth:`read` fetches every pending step's metrics in one ``jax.device_get``, then gives
  each loss to ``watch`` (which raises at the first non-finite one under "stop", before
  any later step is logged or saved) and each step to ``log`` (a :class:`StepLog`).
  :meth:`settle`, before a save, reads every queued step and returns ``written()``, a wait
  for the records written so far (a bucket's writers send them in the background), which the
  save calls on its own thread before it saves (``Checkpoints.step_done``). The rule: a
  checkpoint at step ``s`` is committed only after every record up to ``s`` is in the
  workdir, so a resume from it finds all of them (and moves any later ones aside,
  ``workdir.keep_metrics_until``); the loop itself never waits on an object write, only on
  the previous save at the next one, as for its write, and at exit.
  """

  def __init__(self, watch: divergence.LossWatch, log: "StepLog", written=lambda: None):
    self.watch, self.log, self.written = watch, log, written
    self.queue: list[tuple[int, dict]] = []

  def add(self, step: int, metrics: dict) -> None:
    """Queues ``step``'s metrics (device arrays) without reading them."""
    self.queue.append((step, metrics))

  def read(self, params=None) -> None:
    """Reads, checks and logs every queued step; ``params``: the last step's, for an eval."""
    queue, self.queue = self.queue, []
    values = jax.device_get([metrics for _, metrics in queue])
    for (step, _), metrics in zip(queue, values):
      metrics = {key: float(value) for key, value in metrics.items()}
      if not self.watch.observe(step, metrics["loss"], metrics["l2_params"]):  # May raise.
        logging.warning("step %d: loss %s, update skipped", step, metrics["loss"])
      self.log(step, metrics, params)

  def evaluate(self, step: int, state) -> None:
    """The eval hook: reads every queued step, the last one with ``state``'s params."""
    del step
    self.read(state["params"])

  def settle(self) -> Callable[[], None] | None:
    """Reads every queued step; returns a wait until their records are written."""
    self.read()
    return self.written()


def logs_step(step: int, config) -> tuple[bool, bool]:
  """(whether ``step`` is logged, whether it is evaluated).

  Logged: step 1, every ``config.log_every`` steps and every eval; evaluated: every
  ``config.eval_every`` steps and the last.

  Example:
    >>> import ml_collections
    >>> config = ml_collections.ConfigDict(dict(log_every=10, eval_every=25, total_steps=30))
    >>> [step for step in range(1, 31) if logs_step(step, config)[0]]
    [1, 10, 20, 25, 30]
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
  (``checkpoint.Start``: its ``step`` and ``opt_start``).
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


def mean_loss(eval_step, params, batches, batch_sharding) -> float:
  """The mean of ``eval_step`` over the held-out ``batches`` (this process's rows of each).

  Example: ``evaluate = lambda params: mean_loss(step.eval, params, batches, sharding)``.
  """
  return float(np.mean([eval_step(params, batching.to_global(b, batch_sharding)) for b in batches]))
