"""Named-size presets shared by the model definitions."""
import dataclasses
from typing import Mapping, TypeVar

Config = TypeVar("Config")


def pick(presets: Mapping[str, Config], size: str, **overrides) -> Config:
  """Returns `presets[size]` with the dataclass fields in `overrides` replaced.

  Example: `pick({"tiny": Cfg(depth=2)}, "tiny", depth=4) == Cfg(depth=4)`.
  """
  if size not in presets:
    raise ValueError(f"Unknown size {size!r}; choose from {sorted(presets)}")
  return dataclasses.replace(presets[size], **overrides)
