"""Helpers shared by the config files.

Example:
  >>> parse_arg("size=small,steps=100", size="tiny", steps=200)
  {'size': 'small', 'steps': 100}
"""

from trainers.errors import ConfigError


def parse_arg(arg: str | None, **defaults) -> dict:
  """`key=value,...` from `--config file.py:arg`; values take the type of their default."""
  values = dict(defaults)
  for item in filter(None, (arg or "").split(",")):
    key, _, value = item.partition("=")
    if key not in defaults or not value:
      raise ConfigError(
          f"config arg {item!r}: expected key=value with key in " f"{sorted(defaults)}"
      )
    values[key] = type(defaults[key])(value)
  return values
