"""Errors of the trainer: config mistakes, by kind, under the project's one root.

``ConfigError`` (the library's, shared with the trainer) covers anything wrong in a training config (an unknown model,
task, optimizer, config key or argument, a value out of range);
``OptimizerError`` narrows it to the optimizer's name and arguments;
``NonFiniteLossError`` stops a run whose loss diverged. All are
``bv_sharding.Error``, so ``except bvs.Error`` catches every mistake of ours.
Messages about an unknown name end with the closest known one (:func:`closest`).

Example:
  >>> import bv_sharding as bvs
  >>> issubclass(OptimizerError, ConfigError) and issubclass(ConfigError, bvs.Error)
  True
"""

import difflib

from bv_sharding import Error
from bv_sharding.big_vision import ConfigError
from bv_sharding.optimizers import OptimizerError

__all__ = ["ConfigError", "NonFiniteLossError", "OptimizerError", "closest", "nearest"]


class NonFiniteLossError(Error):
  """Training produced a NaN or infinite loss; the message gives the step and the last finite loss."""


def closest(name: str, choices) -> str:
  """A ``"; did you mean 'x'?"`` hint for ``name`` among ``choices``, or ``""``.

  Example:
    >>> closest("adamw_", ["adamw", "sgd"])
    "; did you mean 'adamw'?"
    >>> closest("zzz", ["adamw", "sgd"])
    ''
  """
  match = nearest(name, choices)
  return f"; did you mean {match!r}?" if match else ""


def nearest(name: str, choices) -> str | None:
  """The choice closest to ``name`` (as ``difflib`` judges, cutoff 0.5), or ``None``.

  Example:
    >>> nearest("warmup_step", ["warmup_steps", "decay_type"])
    'warmup_steps'
  """
  match = difflib.get_close_matches(str(name), [str(c) for c in choices], n=1, cutoff=0.5)
  return match[0] if match else None
