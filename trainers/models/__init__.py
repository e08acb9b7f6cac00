"""Model registry: `get_model(name, **kwargs)` -> flax.linen Module.

Example:
  >>> model = get_model("llama", size="tiny", scan_layers=True)
  >>> model = get_model("vit", size="tiny", num_classes=10)
"""
from typing import Callable

import flax.linen as nn

from bv_sharding import ShardingError

from trainers.models import llama
from trainers.models import vit

MODELS: dict[str, Callable[..., nn.Module]] = {
    "llama": llama.build,
    "vit": vit.build,
}


class UnknownModelError(ShardingError):
  """Raised by `get_model` for a name that is not in `MODELS`."""


def get_model(name: str, **kwargs) -> nn.Module:
  """Builds model `name`; kwargs go to its `build` (e.g. size, scan_layers).

  Example: `get_model("llama", size="125m", remat=True)`.
  """
  if name not in MODELS:
    raise UnknownModelError(
        f"Unknown model {name!r}; choose from {sorted(MODELS)}")
  return MODELS[name](**kwargs)
