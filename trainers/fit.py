"""What makes a train step fit its devices: the step compiled first, then what would fit, checked.

:func:`checked_step` compiles a run's train step from abstract inputs (nothing allocated).
If XLA refuses it, or its figures exceed each device's memory, it compiles at most three
candidates (``trainers/figures/memory.py`` :func:`~trainers.figures.memory.candidates`:
more microbatches, remat, bfloat16 state or params) in the order printed, stopping at the
first that fits, and raises one ``ConfigError`` line that gives each as "checked" (with its
figure), "not checked" (after one that fits) or "not checked here" (more devices: this host
has what it has).

Example: ``step = checked_step(run, memory.budget(jax.local_devices()))``.
"""

from collections.abc import Callable

from absl import logging

from trainers import build, steps
from trainers.errors import ConfigError
from trainers.figures import memory
from trainers.figures.memory import Candidate, StepMemory


def checked_step(run: build.Run, have: memory.Budget, log: Callable = logging.info) -> build.Step:
  """``run``'s :class:`build.Step` once it fits ``have``; else raises one ``ConfigError``
  naming its figures and each candidate as checked or not (see the module docstring).

  ``log`` gets the figures that fit, or the line saying what is being compiled.
  """
  try:
    step = build.compile_step(run)
    if memory.fits(step.figures, have):
      log(memory.fitted(step.figures, have))
      return step
    error = memory.too_big(step.figures, have, run.plan)
  except ConfigError as e:
    error = e
  step = getattr(error, "step", None)  # memory.out_of_memory's figures.
  if step is None or have.per_device is None:
    raise error
  batch = steps.checked_batch_sharding(run.config, run.mesh)
  rows = batch.shard_shape((run.config.batch_size,))[0]
  found = memory.candidates(step, have.per_device, run.plan, run.config, rows)
  raise memory.out_of_memory(f"{error}. Would fit: {tried(run, found, have, log)}", step)


def tried(run: build.Run, found: list[Candidate], have: memory.Budget, log: Callable) -> str:
  """``found`` in words, each compiled in order until one fits: "checked" with its figure,
  or "not checked here" (a change this host cannot compile, or one after a fit)."""
  checkable = [c.flag for c in found if c.overrides is not None]
  log(
      f"the train step does not fit: compiling {len(checkable)} candidates on this host's "
      f"devices to see what would ({', '.join(checkable)})"
  )
  texts, done = [], False
  for c in found:
    if c.overrides is None or done:
      texts.append(f"{c.flag} ({c.why}; not checked{' here' if c.overrides is None else ''})")
      continue
    figures = candidate_figures(run, c.overrides)
    done = figures is not None and memory.fits(figures, have)
    texts.append(f"{c.flag} ({c.why}; checked: {verdict(figures, done)})")
  return ", or ".join(texts)


def verdict(figures: StepMemory | None, done: bool) -> str:
  """A checked candidate's figure and whether it fits.

  Example:
    >>> verdict(StepMemory(0, 2**30, 0, 0), True), verdict(None, False)
    ('1.00 GiB per device, fits', 'XLA refused to compile it')
  """
  if figures is None:
    return "XLA refused to compile it"
  return f"{memory.size(figures.total)} per device, {'fits' if done else 'does not fit'}"


def candidate_figures(run: build.Run, overrides: dict) -> StepMemory | None:
  """The memory figures of ``run``'s train step with the config keys ``overrides`` set
  (dotted, e.g. ``{"model.remat": True}``), compiled from abstract inputs on ``run``'s mesh:
  those XLA names where it refuses the step (None where it names none)."""
  source = run.config.source.copy_and_resolve_references()
  source.update_from_flattened_dict(overrides)
  try:
    return build.compile_step(build.build(source, run.mesh)).figures
  except ConfigError as e:
    if not hasattr(e, "step"):  # Not memory.out_of_memory's: not a question of memory.
      raise
    return e.step
