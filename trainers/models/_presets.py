"""Named-size presets shared by the model definitions."""

import dataclasses
from collections.abc import Mapping
from typing import TypeVar

from trainers.errors import ConfigError, closest

Config = TypeVar("Config")


def pick(presets: Mapping[str, Config], size: str, **overrides) -> Config:
  """Returns ``presets[size]`` with the dataclass fields in ``overrides`` replaced.

  Example:
    >>> import dataclasses
    >>> Cfg = dataclasses.make_dataclass("Cfg", ["depth"], frozen=True)
    >>> pick({"tiny": Cfg(depth=2)}, "tiny", depth=4)
    Cfg(depth=4)
  """
  if size not in presets:
    raise ConfigError(
        f"config.model.size={size!r} is not a size{closest(size, presets)} "
        f"Choose from {sorted(presets)}."
    )
  return dataclasses.replace(presets[size], **overrides)
