"""SIGTERM at a step boundary every process agrees on: the run saves that step and stops.

A :class:`Preemption` learns of the signal; :func:`hook` is the loop's "preemption" hook
(``loop.add_hook(hook(preemption, save), name="preemption")``, every step): once the signal
reached a step, it calls ``save(step, state)`` (the trainer's: ``Checkpoints.preempted``,
which saves the step unless saved already and waits for the write) and stops the loop. The
run exits 0, and a run on the same workdir resumes from that step.

Example:
  >>> class Signal:  # A Preemption whose SIGTERM arrives at step 3.
  ...   def reached(self, step):
  ...     return step == 3
  >>> after = hook(Signal(), lambda step, state: print("saved", step, state))
  >>> [after(step, f"state {step}") for step in (1, 2, 3)]
  saved 3 state 3
  [False, False, True]
"""

import signal
from collections.abc import Callable
from typing import Any

import jax
from absl import logging
from jax.experimental import multihost_utils


class Preemption:
  """SIGTERM at a step boundary that every process agrees on.

  Several processes: jax's preemption sync point (the coordination service
  catches SIGTERM on any process and picks the same step for all; it must be asked once per
  step, in step order). One process: a SIGTERM handler, installed here, sets a flag read at
  the next step.

  Example: ``if Preemption().reached(step): save_and_exit()``.
  """

  def __init__(self):
    self.signalled = False
    self.multi = jax.process_count() > 1
    if not self.multi:
      signal.signal(signal.SIGTERM, self._on_sigterm)

  def _on_sigterm(self, signum, frame):
    del signum, frame
    logging.info("SIGTERM: saving at the end of this step")
    self.signalled = True

  def reached(self, step: int) -> bool:
    if self.multi:
      return multihost_utils.reached_preemption_sync_point(step)
    return self.signalled


def hook(preemption, save: Callable[[int, Any], Any]) -> Callable[[int, Any], bool]:
  """The loop's hook ``after(step, state)``: True (stop) once ``preemption.reached(step)``,
  after ``save(step, state)``; False otherwise. ``preemption``: a :class:`Preemption`."""

  def after(step: int, state) -> bool:
    if not preemption.reached(step):
      return False
    save(step, state)
    return True

  return after
