"""A command's start-up lines, held until its checks pass, so that a mistake is its first line.

A run checks its config, mesh, data, plan and compiled step before anything is allocated;
each check logs a line, and the backends and libraries it starts log theirs (jax's, Python
warnings such as a TPU runtime's). :func:`hold` keeps every record the root logger's handlers
would print, and every Python warning shown, from then on. :func:`release` prints them in
order once the checks passed (or before a slow check says what it is doing). :func:`drop`,
called where an error of ours is reported, prints only the project's own warnings among them
(its log warnings, and warnings of its categories, e.g. ``bv_sharding.ShardingWarning``): the
error line comes right after them. ``cli.command`` releases what is still held when the
command ends otherwise (a traceback then follows the lines that led to it).

Example:
  >>> import logging
  >>> logging.getLogger().addHandler(handler := logging.NullHandler())
  >>> hold()
  >>> logging.getLogger("some.library").warning("held")
  >>> len(_HELD) > 0
  True
  >>> drop()  # An error of ours: the library's warning is not printed.
  >>> _HELD, logging.getLogger().removeHandler(handler)
  ([], None)
"""

import logging
import warnings
from collections.abc import Callable

_OURS = ("bv_sharding", "trainers")  # Packages whose warnings an error line keeps.
_LOGGERS = ("absl", "root")  # Loggers the commands log through (absl.logging's).
# (print it, is it ours) for each line held since hold(); what hold() replaced, to restore.
_HELD: list[tuple[Callable[[], None], bool]] = []
_REPLACED: dict = {}


def hold() -> None:
  """Holds what the root logger's handlers would print, and Python warnings, until
  :func:`release` or :func:`drop`."""
  if _REPLACED:
    return
  _REPLACED["showwarning"] = shown = warnings.showwarning
  warnings.showwarning = lambda *args, **kwargs: _HELD.append(_warning(shown, *args, **kwargs))
  for handler in logging.getLogger().handlers:
    _REPLACED[handler] = _holding_filter(handler)
    handler.addFilter(_REPLACED[handler])


def release() -> None:
  """Prints every held line, in order, and stops holding."""
  for emit, _ in _stop():
    emit()


def drop() -> None:
  """Stops holding; of the held lines, prints only the project's own warnings."""
  for emit, ours in _stop():
    if ours:
      emit()


def _holding_filter(handler: logging.Handler) -> Callable[[logging.LogRecord], bool]:
  def holding(record: logging.LogRecord) -> bool:
    ours = record.levelno >= logging.WARNING and record.name in _LOGGERS
    _HELD.append((lambda: handler.handle(record), ours))
    return False

  return holding


def _warning(shown: Callable, message, category, *args, **kwargs):
  ours = category.__module__.split(".")[0] in _OURS
  return (lambda: shown(message, category, *args, **kwargs), ours)


def _stop() -> list[tuple[Callable[[], None], bool]]:
  shown = _REPLACED.pop("showwarning", None)
  if shown is not None:
    warnings.showwarning = shown
  for handler, holding in _REPLACED.items():
    handler.removeFilter(holding)
  _REPLACED.clear()
  held = list(_HELD)
  _HELD.clear()
  return held
