"""Helpers shared by the config files.

Example:
  >>> parse_arg("size=small,steps=100,scan=False", size="tiny", steps=200, scan=True)
  {'size': 'small', 'steps': 100, 'scan': False}
"""

from trainers.errors import ConfigError

_BOOLS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


def parse_arg(arg: str | None, **defaults) -> dict:
  """`key=value,...` from `--config file.py:arg`; values take the type of their default.

  A bool default reads `True/False` (also `true/false`, `1/0`, `yes/no`): `flag=False`
  gives False.
  """
  values = dict(defaults)
  for item in filter(None, (arg or "").split(",")):
    key, _, value = item.partition("=")
    if key not in defaults or not value:
      raise ConfigError(
          f"config arg {item!r}: expected key=value with key in " f"{sorted(defaults)}"
      )
    values[key] = _typed(key, value, defaults[key])
  return values


def _typed(key: str, value: str, default):
  if isinstance(default, bool):
    if value.lower() not in _BOOLS:
      raise ConfigError(f"config arg {key}={value!r}: expected True or False")
    return _BOOLS[value.lower()]
  try:
    return type(default)(value)
  except ValueError:
    raise ConfigError(
        f"config arg {key}={value!r}: expected a {type(default).__name__} like {default!r}"
    ) from None
