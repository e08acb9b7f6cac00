"""``config.profile_steps``: a ``jax.profiler`` trace of a few train steps, for TensorBoard.

``(start, stop)`` traces steps ``start`` .. ``stop - 1`` into ``<workdir>/profile/``
(``plugins/profile/<run>/*.xplane.pb``, which TensorBoard's profiler tab reads);
None traces nothing. The trace stops once the last traced step's state is ready, so it
holds that step's device work. jax's profiler writes to local paths only: with a URL
workdir (``gs://``) it traces into a local temporary directory whose files are moved into
``<workdir>/profile/`` through ``etils.epath`` when the trace stops (:func:`paths.move`).

Example:
  >>> trace = StepTrace(None, "/tmp/unused")
  >>> trace.before(1); trace.after(1, state=None); trace.close()  # profiles nothing
"""

import os
import tempfile

import jax

from trainers.rundir import paths

PROFILE = "profile"


class StepTrace:
  """Starts the trace before step ``start``, stops it after step ``stop - 1`` (or at the end)."""

  def __init__(self, profile_steps: tuple[int, int] | None, workdir: str):
    self.steps = tuple(profile_steps) if profile_steps else None
    self.directory = os.path.join(workdir, PROFILE)
    self.local: str | None = None  # Where jax writes the running trace.

  @property
  def tracing(self) -> bool:
    return self.local is not None

  def before(self, step: int) -> None:
    """Starts tracing when ``step`` is the first step profiled."""
    if self.steps and step == self.steps[0]:
      remote = paths.is_url(self.directory)
      self.local = tempfile.mkdtemp(prefix="profile-") if remote else self.directory
      jax.profiler.start_trace(self.local)

  def after(self, step: int, state) -> None:
    """Stops tracing, once ``state`` is computed, when ``step`` is the last step profiled."""
    if self.tracing and step == self.steps[1] - 1:
      jax.block_until_ready(state)
      self.close()

  def close(self) -> None:
    """Stops a trace still running (a run that ended inside the profiled steps); a URL
    workdir's trace is moved there."""
    if self.tracing:
      jax.profiler.stop_trace()
      local, self.local = self.local, None
      if local != self.directory:
        paths.move(paths.path(local), paths.path(self.directory))
