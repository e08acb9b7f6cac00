"""The project's errors: one root, one subclass per kind.

Every mistake in a config, strategy, mesh or input raises a subclass of
:class:`Error` (a ``ValueError``) whose message names the offending value and
the fix. The library raises :class:`ShardingError`; the trainer raises
``trainers.errors.ConfigError``; ``except bvs.Error`` catches both.

Example:
  >>> import bv_sharding as bvs
  >>> try:
  ...   bvs.lookup("fsdpp")
  ... except bvs.Error as e:
  ...   print(type(e).__name__, e)
  ShardingError unknown op 'fsdpp'; did you mean 'fsdp'? Registered ops: ...
"""

import difflib


class Error(ValueError):
  """Root of the project's errors: a user mistake, named with its fix, caught before any work."""


class ShardingError(Error):
  """A strategy, rule, mesh or plan the library cannot use; the message names it and the fix."""


class ShardingWarning(UserWarning):
  """A plan that works but is probably not what was meant, e.g. a strategy entry matching no leaf."""


def closest(name: str, choices) -> str:
  """A ``"; did you mean 'x'?"`` hint for ``name`` among ``choices``, or ``""``.

  Example:
    >>> closest("fsdpp", ["fsdp", "replicate"])
    "; did you mean 'fsdp'?"
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
