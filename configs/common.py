"""Helpers shared by the config files.

Example:
  >>> parse_arg("size=small,steps=100", size="tiny", steps=200)
  {'size': 'small', 'steps': 100}
  >>> base_config().optax_name
  'adamw'
"""

import ml_collections

from trainers.errors import ConfigError


def base_config() -> ml_collections.ConfigDict:
  """The keys every training config shares, at their usual values; each config sets the rest."""
  config = ml_collections.ConfigDict()
  config.seed = 0
  config.eval_batches = 4  # Fixed held-out batches, the same at every eval.
  config.log_every = 20
  config.mesh = (("data", -1),)
  config.sharding_rules = (("act_batch", "data"),)
  config.data_axes = ()  # () = the mesh axes the "act_batch" rule maps to.
  config.optax_name = "adamw"
  config.optax = dict()
  config.wd = 1e-4
  config.grad_clip_norm = 1.0
  return config


def parse_arg(arg: str | None, **defaults) -> dict:
  """``key=value,...`` from ``--config file.py:arg``; values take the type of their default."""
  values = dict(defaults)
  for item in filter(None, (arg or "").split(",")):
    key, _, value = item.partition("=")
    if key not in defaults or not value:
      raise ConfigError(
          f"config arg {item!r}: expected key=value with key in " f"{sorted(defaults)}"
      )
    values[key] = type(defaults[key])(value)
  return values
