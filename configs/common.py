"""Helpers shared by the config files.

Example:
  >>> parse_arg("size=small,steps=100,scan=False", size="tiny", steps=200, scan=True)
  {'size': 'small', 'steps': 100, 'scan': False}
  >>> base_config().optax_name
  'adamw'
"""

import ml_collections

from trainers.errors import ConfigError

_BOOLS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


def base_config() -> ml_collections.ConfigDict:
  """The keys every training config shares, at their usual values; each config sets the rest.

  Every key is declared, with its type, meaning and check, in trainers/settings/schema.py
  (``tests/trainer/test_schema.py`` checks that these values are its defaults).
  """
  config = ml_collections.ConfigDict()
  config.seed = 0
  config.eval_batches = 4  # Fixed held-out batches, the same at every eval.
  config.log_every = 20
  config.eval_every = 100
  config.mesh = (("data", -1),)
  config.dcn_mesh = ()  # Across TPU slices, e.g. (("data", 2),); () = one slice.
  # "explicit": jax's sharding-in-types mesh (params gathered to their compute specs in the
  # loss, activations resharded by config.sharding_rules); "auto": XLA places the rest.
  config.mesh_axis_types = "auto"
  config.sharding_rules = (("act_batch", "data"),)
  config.data_axes = ()  # () = the mesh axes the "act_batch" rule maps to.
  # Dtypes (trainers/precision.py): activations and matmuls, stored params, optimizer state
  # (None: the params' dtype). "bfloat16" for any; losses, softmax and updates stay float32.
  config.compute_dtype = "float32"
  config.param_dtype = "float32"
  config.state_dtype = ml_collections.config_dict.placeholder(str)
  # Microbatches each global batch is split into inside the train step (trainers/steps.py).
  config.grad_accum_steps = 1
  config.optax_name = "adamw"
  config.optax = dict()
  config.wd = 1e-4
  config.grad_clip_norm = 1.0  # None: no clipping.
  # Refuse to start when more of the state's bytes is unsharded (None: no gate).
  config.max_unsharded_fraction = ml_collections.config_dict.placeholder(float)
  # Memory each device may use, in GiB, for the checks before a run (trainers/figures/memory.py);
  # None: ask the devices (on CPU: the host's available memory shared by them).
  config.device_memory_gib = ml_collections.config_dict.placeholder(float)
  # Steps over which an optimizer state born mid-run (another optax_name on resume) is ramped
  # in, min(1, n / rewarmup_steps) (0: not at all); its schedule continues at the global step
  # either way. A fresh run's updates are not scaled (docs/durability.md).
  config.rewarmup_steps = 5
  config.on_nonfinite = "stop"  # A NaN/inf loss ends the run; "skip": skip that update.
  # big_vision's keys: save every ckpt_steps (and at the end, and on SIGTERM); keep the
  # checkpoints at multiples of keep_ckpt_steps for good (else only the latest is kept).
  config.ckpt_steps = 100
  config.keep_ckpt_steps = ml_collections.config_dict.placeholder(int)
  config.model_init = ml_collections.config_dict.placeholder(str)  # a workdir or checkpoint
  # (start, stop): a jax.profiler trace of steps start..stop-1 into workdir/profile/ (TensorBoard's
  # profiler), e.g. --config.profile_steps="(10, 13)"; None: no trace.
  config.profile_steps = ml_collections.config_dict.placeholder(tuple)
  return config


def parse_arg(arg: str | None, **defaults) -> dict:
  """``key=value,...`` from ``--config file.py:arg``; values take the type of their default.

  A bool default reads ``True/False`` (also ``true/false``, ``1/0``, ``yes/no``):
  ``flag=False`` gives False.
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
