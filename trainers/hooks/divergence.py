"""What a run does when its loss stops being finite: ``config.on_nonfinite``, "stop" or "skip".

"stop" (the default) ends the run at the first NaN or infinite loss with a
``NonFiniteLossError`` giving the step and the last finite loss. "skip" wraps the
optimizer in ``optax.apply_if_finite``, so an update from non-finite gradients is not
applied, and the run goes on; ``MAX_SKIPPED`` such steps in a row stop it as "stop" would.

Example:
  >>> import optax
  >>> tx = guard(optax.adam(1e-3), "stop")  # before planning: "skip" adds state leaves
  >>> records = []
  >>> watch = LossWatch("stop", lr=1e-3, write=records.append)
  >>> watch.observe(1, 2.5)
  True
  >>> watch.observe(2, float("nan"))
  Traceback (most recent call last):
  ...
  trainers.errors.NonFiniteLossError: step 2: the loss is nan; the last finite loss was 2.5 ...
  >>> records[-1]["step"]
  2
"""

import math
from collections.abc import Callable

import optax

from trainers.errors import NonFiniteLossError

MAX_SKIPPED = 10
_NEVER_APPLY = 2**31 - 1  # apply_if_finite applies anyway after this many; we never want that.


def guard(tx: optax.GradientTransformation, policy: str) -> optax.GradientTransformation:
  """``tx``, or under "skip" ``tx`` that leaves params and state alone on non-finite gradients.

  Example: ``guard(optax.adamw(1e-3), "skip")`` is an ``optax.apply_if_finite`` transformation.
  """
  return optax.apply_if_finite(tx, _NEVER_APPLY) if policy == "skip" else tx


class LossWatch:
  """Remembers the last finite loss and applies the policy to a non-finite one.

  ``write`` (e.g. ``MetricsWriter.write``) gets a last record ``{"step", "loss", "stopped"}``
  before the run stops.
  """

  def __init__(self, policy: str, lr: float, write: Callable[[dict], None] | None = None):
    self.policy, self.lr, self.write = policy, lr, write
    self.last: tuple[int, float] | None = None
    self.skipped = 0

  def observe(self, step: int, loss: float, l2_params: float = 0.0) -> bool:
    """True for a finite loss; False for a skipped step; raises when the run must stop.

    ``l2_params``: the norm of the params the step's update made; a non-finite one stops
    the run under either policy (the update already happened: nothing is left to skip).

    Example: ``LossWatch("skip", 1e-3).observe(7, float("inf"))`` is False.
    """
    if math.isfinite(loss) and not math.isfinite(l2_params):
      message = (
          f"step {step}: the loss was {loss:.6g} but the updated params are not finite (their "
          f"norm is {l2_params}). Lower config.lr (now {self.lr}), set config.grad_clip_norm, "
          "or check config.optax (a decay of 1 divides by zero)"
      )
      self._stop({"step": step, "loss": loss, "l2_params": l2_params, "stopped": message})
    if math.isfinite(loss):
      self.last, self.skipped = (step, loss), 0
      return True
    self.skipped += 1
    if self.policy == "skip" and self.skipped < MAX_SKIPPED:
      return False
    message = self.message(step, loss)
    self._stop({"step": step, "loss": loss, "stopped": message})

  def _stop(self, record: dict) -> None:
    """Writes ``record`` (its ``stopped`` says why) and stops the run."""
    if self.write is not None:
      self.write(record)
    raise NonFiniteLossError(record["stopped"])

  def message(self, step: int, loss: float) -> str:
    """Why the run stopped: the step, the loss, the last finite loss and what to change."""
    last = (
        f"the last finite loss was {self.last[1]:.6g} at step {self.last[0]}"
        if self.last
        else "no step had a finite loss"
    )
    run = f" ({self.skipped} steps in a row)" if self.policy == "skip" else ""
    return (
        f"step {step}: the loss is {loss}{run}; {last}. Lower config.lr (now {self.lr}), "
        "set config.grad_clip_norm, or pass --config.on_nonfinite=skip to skip such updates"
    )
