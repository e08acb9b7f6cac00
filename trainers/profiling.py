"""``config.profile_steps``: a ``jax.profiler`` trace of a few train steps, for TensorBoard.

``(start, stop)`` traces steps ``start`` .. ``stop - 1`` into ``<workdir>/profile/``
(``plugins/profile/<run>/*.xplane.pb``, which TensorBoard's profiler tab reads);
None traces nothing. The trace stops once the last traced step's state is ready, so it
holds that step's device work.

Example:
  >>> trace = StepTrace(None, "/tmp/unused")
  >>> trace.before(1); trace.after(1, state=None); trace.close()  # profiles nothing
"""

import os

import jax

PROFILE = "profile"


class StepTrace:
  """Starts the trace before step ``start``, stops it after step ``stop - 1`` (or at the end)."""

  def __init__(self, profile_steps: tuple[int, int] | None, workdir: str):
    self.steps = tuple(profile_steps) if profile_steps else None
    self.directory = os.path.join(workdir, PROFILE)
    self.tracing = False

  def before(self, step: int) -> None:
    """Starts tracing when ``step`` is the first step profiled."""
    if self.steps and step == self.steps[0]:
      jax.profiler.start_trace(self.directory)
      self.tracing = True

  def after(self, step: int, state) -> None:
    """Stops tracing, once ``state`` is computed, when ``step`` is the last step profiled."""
    if self.tracing and step == self.steps[1] - 1:
      jax.block_until_ready(state)
      self.close()

  def close(self) -> None:
    """Stops a trace still running (a run that ended inside the profiled steps)."""
    if self.tracing:
      jax.profiler.stop_trace()
      self.tracing = False
