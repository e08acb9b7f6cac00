"""The library's errors: one root, one subclass per kind.

Every mistake in a strategy, rule, mesh or input raises :class:`ShardingError`
(an :class:`Error`, itself a ``ValueError``) whose message names the offending
value and the fix; a big_vision optimizer section the library cannot build raises
:class:`ConfigError` (an :class:`Error` too), and a bad optimizer argument or state its
:class:`OptimizerError` subclass. A program built on the library can root
its own errors at :class:`Error`, so that ``except bvs.Error`` catches every user mistake.

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
  """Root of the library's errors: a user mistake, named with its fix, caught before any work."""


class ShardingError(Error):
  """A strategy, rule, mesh or plan the library cannot use; the message names it and the fix."""


class ConfigError(Error):
  """A config value (an optimizer section, a schedule, a key) that cannot be used; the message
  names ``config.<key>`` and the fix."""


class OptimizerError(ConfigError):
  """An optimizer's arguments, layout or state the library's optimizers cannot use; the
  message names the value and the fix."""


class ShardingWarning(UserWarning):
  """A plan that works but is probably not what was meant, e.g. a strategy entry matching no leaf."""


def closest(name: str, choices) -> str:
  """A ``"; did you mean 'x'?"`` hint for ``name`` among ``choices`` (as ``difflib`` judges,
  cutoff 0.5), or ``""``.

  Example:
    >>> closest("fsdpp", ["fsdp", "replicate"])
    "; did you mean 'fsdp'?"
  """
  match = difflib.get_close_matches(str(name), [str(c) for c in choices], n=1, cutoff=0.5)
  return f"; did you mean {match[0]!r}?" if match else ""
