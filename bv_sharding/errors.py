"""The one exception type raised for every user mistake.

Example:
  >>> import bv_sharding as bvs
  >>> try:
  ...   bvs.lookup("fsdpp")
  ... except bvs.ShardingError as e:
  ...   print(e)
  unknown op 'fsdpp'; did you mean 'fsdp'? Registered ops: ...
"""
import difflib


class ShardingError(ValueError):
  """A config, strategy, mesh or leaf the plugin cannot use; the message names it and the fix."""


def closest(name: str, choices) -> str:
  """A ``"; did you mean 'x'?"`` hint for ``name`` among ``choices``, or ``""``."""
  match = difflib.get_close_matches(str(name), [str(c) for c in choices], n=1, cutoff=0.5)
  return f"; did you mean {match[0]!r}?" if match else ""
