"""The training loop: the device always has the next step queued while the host reads.

A :class:`Loop` dispatches a train step per ``(step, batch)`` pair and reads the step
metrics (loss, ``l2_grads``, ``l2_params``, ``l2_updates``) in one fetch, once the next step
is queued (:class:`Pending`), checking each loss against the non-finite policy in step
order (``trainers/hooks/divergence.py``). Everything else attaches as a named hook with a
period, ``loop.add_hook(fn, every=N, name=...)``: ``fn(step, state)`` runs after every
``N``-th step and the last one, in the order added, and returning True stops the loop; a
hook's ``read(step, metrics, params)`` gets every step's metrics as they are read, which the
loop does after step 1, at each reading hook's period and the last step. The trainer
(``trainers/train.py``) hangs on it the profile trace (``trainers/rundir/profiling.py``), the
eval (:meth:`Pending.evaluate`), the metrics (``trainers/hooks/metrics.py``: log lines,
metrics.jsonl and TensorBoard every ``config.log_every`` steps), the checkpointer
(:meth:`Loop.add_checkpointer`: every ``config.ckpt_steps`` and at the end,
``trainers/rundir/checkpoint.py``) and the preemption hook (``trainers/hooks/preemption.py``:
on SIGTERM, a save and a stop); the accelerator benchmark runs the same loop with the
metrics hook only.

Example:
  >>> import types
  >>> from trainers.hooks import divergence
  >>> config = types.SimpleNamespace(total_steps=4)
  >>> loop = Loop(lambda state, batch: (state + batch, {"loss": 1.0, "l2_params": 1.0}),
  ...             divergence.LossWatch("stop", 0.1), plan=None, config=config)
  >>> loop.add_hook(name="metrics", every=2, read=lambda step, metrics, params: print("read", step))
  >>> loop.add_hook(lambda step, state: print("eval at", step), every=3, name="eval")
  >>> loop.run(0, zip(range(1, 5), [10, 20, 30, 40]))  # reads step 1 once step 2 is queued
  read 1
  read 2
  eval at 3
  eval at 4
  read 3
  read 4
  100
"""

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

import jax
import numpy as np
from absl import logging

from trainers import steps
from trainers.hooks import divergence
from trainers.input import batching


@dataclasses.dataclass(frozen=True)
class Hook:
  """What :meth:`Loop.add_hook` attaches, under ``name``: ``after(step, state)`` after every
  ``every``-th step and the last (True stops the loop), ``before(step)`` before each step is
  dispatched, ``end(state)`` with the last state once the batches run out, and
  ``read(step, metrics, params)`` with each step's metrics as the loop reads them (after step
  1, every ``every``-th step and the last, once the next step is queued; ``params``: the
  step's at an eval, else None)."""

  name: str
  after: Callable[[int, Any], bool | None] | None = None
  every: int = 1
  before: Callable[[int], None] | None = None
  end: Callable[[Any], None] | None = None
  read: Callable[[int, dict, Any], None] | None = None

  def due(self, step: int, total: int) -> bool:
    """Whether the hook's period ends at ``step``: every ``every``-th step and the last."""
    return step % self.every == 0 or step == total


class Loop:
  """Takes a ``train_step`` per ``(step, batch)``; reads the metrics through its ``pending``.

  ``watch``: the non-finite policy each loss is checked against (``divergence.LossWatch``);
  ``plan``: the state's (its shardings are checked after the first step; None: not
  checked); ``config``: its ``total_steps``; ``written()``: a wait for the records written so
  far, which each save follows (:meth:`Pending.settle`). A step's metrics are read once the
  next step is dispatched, at the steps a reading hook asks for; a hook that needs a step's
  state (an eval, a save) reads them at once (:meth:`Pending.evaluate`,
  :meth:`Pending.settle`). See the module example.
  """

  def __init__(
      self,
      train_step: Callable,
      watch: divergence.LossWatch,
      plan,
      config,
      written: Callable[[], Any] = lambda: None,
  ):
    self.train_step, self.plan, self.config = train_step, plan, config
    self.pending = Pending(watch, self.give, written)
    self.hooks: list[Hook] = []

  def add_hook(
      self,
      fn: Callable[[int, Any], bool | None] | None = None,
      every: int = 1,
      name: str | None = None,
      before: Callable[[int], None] | None = None,
      end: Callable[[Any], None] | None = None,
      read: Callable[[int, dict, Any], None] | None = None,
  ) -> None:
    """Runs ``fn(step, state)`` after every ``every``-th step and the last (True: stop now);
    ``before(step)`` before each step, ``end(state)`` once the batches run out; ``read``
    gets each step's metrics (:class:`Hook`)."""
    name = name or getattr(fn or read, "__name__", "hook")
    self.hooks.append(Hook(name, fn, every, before, end, read))

  def add_checkpointer(self, ckpt) -> None:
    """Hangs ``ckpt`` (``checkpoint.Checkpoints``) on as the "checkpoint" hook: its
    ``step_done`` after every step (a save every ``config.ckpt_steps``), its ``close`` at the
    end; each save settles the pending steps first (:meth:`Pending.settle`)."""
    settle = self.pending.settle
    self.add_hook(
        lambda step, state: ckpt.step_done(step, state, before_save=settle),
        name="checkpoint",
        end=lambda state: ckpt.close(state, before_save=settle),
    )

  def settled(self, save: Callable) -> Callable[[int, Any], Any]:
    """``save(step, state, before_save)`` (e.g. ``Checkpoints.preempted``) as a hook's
    ``(step, state)``, its checkpoint following the pending steps (:meth:`Pending.settle`)."""
    return lambda step, state: save(step, state, before_save=self.pending.settle)

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
      read_next = self.reads(step)
      if self.after(step, state):
        return state  # A hook stopped the run (SIGTERM: every process saved this step).
    self.pending.read()
    for hook in self.hooks:
      if hook.end:
        hook.end(state)
    return state

  def reads(self, step: int) -> bool:
    """Whether ``step``'s metrics are read once the next step is queued: after step 1 and
    where a reading hook's period ends."""
    total = self.config.total_steps
    return any(h.read and (step == 1 or h.due(step, total)) for h in self.hooks)

  def after(self, step: int, state) -> bool:
    """Runs the hooks due after ``step`` (every ``hook.every`` steps and the last), in order,
    until one says stop; True if one did."""
    total = self.config.total_steps
    for hook in self.hooks:
      if hook.after and hook.due(step, total) and hook.after(step, state):
        return True
    return False

  def give(self, step: int, metrics: dict, params) -> None:
    """Gives a step's metrics, as read, to each hook that reads them, in order."""
    for hook in self.hooks:
      if hook.read:
        hook.read(step, metrics, params)


class Pending:
  """The train step's metrics, left on the device until the loop reads them, in step order.

  :meth:`read` fetches every pending step's metrics in one ``jax.device_get``, then gives
  each loss to ``watch`` (which raises at the first non-finite one under "stop", before
  any later step is logged or saved) and each step to ``log`` (the loop's :meth:`Loop.give`:
  the hooks that read it, e.g. ``trainers.hooks.metrics.StepLog``).
  :meth:`settle`, before a save, reads every queued step and returns ``written()``, a wait
  for the records written so far (a bucket's writers send them in the background), which the
  save calls on its own thread before it saves (``Checkpoints.step_done``). The rule: a
  checkpoint at step ``s`` is committed only after every record up to ``s`` is in the
  workdir, so a resume from it finds all of them (and moves any later ones aside,
  ``workdir.keep_metrics_until``); the loop itself never waits on an object write, only on
  the previous save at the next one, as for its write, and at exit.
  """

  def __init__(self, watch: divergence.LossWatch, log: Callable, written=lambda: None):
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


def mean_loss(eval_step, params, batches, batch_sharding) -> float:
  """The mean of ``eval_step`` over the held-out ``batches`` (this process's rows of each).

  Example: ``evaluate = lambda params: mean_loss(step.eval, params, batches, sharding)``.
  """
  return float(np.mean([eval_step(params, batching.to_global(b, batch_sharding)) for b in batches]))
