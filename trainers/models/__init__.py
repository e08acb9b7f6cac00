"""Model registry: ``get_model(name, **kwargs)`` -> a ``flax.linen`` Module.

Example:
  >>> get_model("llama", size="tiny", scan_layers=True).config.n_layers
  2
  >>> get_model("vit", size="tiny", num_classes=10).num_classes
  10
  >>> from configs import lm
  >>> config = lm.get_config()
  >>> config.compute_dtype = "bfloat16"
  >>> model = from_config(config)
  >>> model.dtype, model.param_dtype
  ('bfloat16', 'float32')
"""

from collections.abc import Callable

import flax.linen as nn

from trainers import precision
from trainers.errors import ConfigError, closest
from trainers.models import llama, vit

MODELS: dict[str, Callable[..., nn.Module]] = {
    "llama": llama.build,
    "vit": vit.build,
}


def get_model(name: str, **kwargs) -> nn.Module:
  """Builds model ``name``; kwargs go to its ``build`` (e.g. size, scan_layers).

  Raises:
    ConfigError: ``name`` is not in ``MODELS`` (the message names the closest one).
  """
  if name not in MODELS:
    raise ConfigError(
        f"config.model_name={name!r} is not a model{closest(name, MODELS)} Choose from {sorted(MODELS)}."
    )
  return MODELS[name](**kwargs)


def from_config(config) -> nn.Module:
  """``config.model_name`` built with ``config.model``, computing in ``config.compute_dtype``
  and storing params in ``config.param_dtype``; a ``dtype`` or ``param_dtype`` in
  ``config.model`` wins (see the module example)."""
  dtypes = precision.of_config(config)
  kwargs = {"dtype": dtypes.compute, "param_dtype": dtypes.param, **config.model.to_dict()}
  return get_model(config.model_name, **kwargs)
