"""Names that moved: still importable under the old spelling, with a ``DeprecationWarning``.

A module lists its moved names (old name -> new dotted path, a module's attribute or a
class's method) and serves them through its ``__getattr__``, which Python calls only
for names the module does not define.

Example:
  >>> import warnings
  >>> __getattr__ = deprecated({"old_sqrt": "math.sqrt"}, "example")
  >>> with warnings.catch_warnings(record=True) as caught:
  ...   warnings.simplefilter("always")
  ...   __getattr__("old_sqrt")(9.0)
  3.0
  >>> str(caught[0].message)
  'example.old_sqrt is deprecated; use math.sqrt'
"""

import functools
import importlib
import warnings


def deprecated(moved: dict[str, str], module: str):
  """A module ``__getattr__`` serving each old name of ``moved`` from its new dotted path."""

  def __getattr__(name: str):
    if name not in moved:
      raise AttributeError(f"module {module!r} has no attribute {name!r}")
    top, *path = moved[name].split(".")
    warnings.warn(
        f"{module}.{name} is deprecated; use {moved[name]}", DeprecationWarning, stacklevel=2
    )
    return functools.reduce(getattr, path, importlib.import_module(top))

  return __getattr__
