"""The params' layout from big_vision's config, for the library's optimizers.

big_vision's ``train.py`` builds its mesh from ``config.mesh`` over ``jax.devices()``
(``mesh_utils.create_device_mesh``, physical axes split only with
``config.mesh_allow_split_physical_axes``) and places the params with
``config.sharding_strategy`` under ``config.sharding_rules``, after ``bv_optax.make``.
:func:`layout_of` makes the same mesh and the same plan of the params, with the same
defaults, so Kron, Shampoo and Muon compute each block or matrix where ``train.py``'s
params will be: no argument beyond big_vision's ``make(config, params, sched_kw=...)``.

``make`` gets the params unboxed (``nn.unbox(params_shape)``), so a
``logical_partitioning`` op sees no flax names there and the strategy's next op decides;
big_vision's own models carry no names, and a model that does gets the same math with
its blocks gathered to this layout. For the same reason the layers a model stacks with
``nn.scan`` (big_vision's ViT with ``scan=True``: ``Transformer/encoderblock/...``, dim 0 the
depth) are named by the config: ``config.scanned_layers``, a regex or a list of them over the
param names as ``config.schedule``'s (:func:`scanned_layers`). Kron, Shampoo and SOAP then
precondition each layer of those params as its own matrix, as they would the layers unscanned.

Example:
  >>> import jax
  >>> params = {"w": jax.ShapeDtypeStruct((64, 32), "float32")}
  >>> config = dict(mesh=[("data", -1)], sharding_strategy=[(".*", 'fsdp(axis="data", min_size_to_shard_mb=0)')])
  >>> layout = layout_of(config, params)
  >>> layout.specs["w"], dict(layout.mesh.shape)  # the 8 simulated test devices
  (P('data', None), {'data': 8})
"""

import warnings

import jax
from jax.experimental import mesh_utils

from bv_sharding import names
from bv_sharding.big_vision.masks import first_match
from bv_sharding.errors import ConfigError, ShardingWarning
from bv_sharding.mesh import axis_sizes
from bv_sharding.optimizers.layout import ParamLayout
from bv_sharding.planning import plan

__all__ = ["DEFAULT_RULES", "DEFAULT_STRATEGY", "layout_of", "mesh_of", "scanned_layers"]

DEFAULT_STRATEGY = ((".*", "replicate"),)  # train.py's defaults when the config has none.
DEFAULT_RULES = (("act_batch", "data"),)


def mesh_of(config) -> jax.sharding.Mesh:
  """``train.py``'s mesh: ``config.mesh`` (default ``[("data", jax.device_count())]``, a
  ``-1`` taking the rest) over ``jax.devices()``, as big_vision's ``create_device_mesh``.

  Raises:
    ShardingError: sizes that do not fit the devices (naming ``config.mesh`` and the fix).
  """
  devices = jax.devices()
  names, sizes = axis_sizes(config.get("mesh") or [("data", len(devices))], len(devices))
  array = mesh_utils.create_device_mesh(
      sizes,
      devices=devices,
      allow_split_physical_axes=config.get("mesh_allow_split_physical_axes", False),
  )
  return jax.sharding.Mesh(array, names)


def layout_of(config, params) -> ParamLayout:
  """The :class:`~bv_sharding.optimizers.ParamLayout` of ``params`` (arrays or shapes) under
  ``config.sharding_strategy`` and ``config.sharding_rules`` on :func:`mesh_of`.

  The params are planned as ``train.py``'s ``{"params": ...}`` so the strategy's regexes see
  the same names; its warnings (an ``opt/...`` entry matching no param) are left to the
  train state's own plan. Its ``stacked`` leaves are :func:`scanned_layers`'.

  Raises:
    ConfigError: a ``config.scanned_layers`` mistake (:func:`scanned_layers`).
    ShardingError: a ``config.mesh`` that does not fit the devices, or a strategy mistake.
  """
  stacked = scanned_layers(config, params)
  strategy = config.get("sharding_strategy") or list(DEFAULT_STRATEGY)
  rules = config.get("sharding_rules") or list(DEFAULT_RULES)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", ShardingWarning)
    params_plan = plan({"params": params}, strategy, mesh_of(config), rules=rules)
  return ParamLayout.from_plan(params_plan, stacked)


def scanned_layers(config, params):
  """A bool per leaf of ``params``: whether ``config.scanned_layers`` (a regex, or a list of
  them, fullmatching the ``/``-joined param names as ``config.schedule``'s do) names it a
  stack of layers, dim 0 the layers (``nn.scan``'s params); None without the key.

  Example:
      >>> params = {"encoderblock": {"kernel": jax.ShapeDtypeStruct((12, 64, 64), "float32")},
      ...           "head": {"kernel": jax.ShapeDtypeStruct((64, 10), "float32")}}
      >>> scanned_layers({"scanned_layers": "encoderblock/.*"}, params)
      {'encoderblock': {'kernel': True}, 'head': {'kernel': False}}

  Raises:
    ConfigError: a value that is not a regex or a list of them, a regex that names no
      param, or a named param of fewer than 2 dims (no layer of it is a matrix or a vector).
  """
  patterns = config.get("scanned_layers")
  if patterns is None:
    return None
  patterns = [patterns] if isinstance(patterns, str) else patterns
  if not isinstance(patterns, (list, tuple)) or not all(isinstance(p, str) for p in patterns):
    raise ConfigError(
        f"config.scanned_layers={patterns!r}: write a regex of the stacked params' names, or a "
        'list of them, e.g. "Transformer/encoderblock/.*"'
    )
  named, treedef = names.flatten(params)
  masks = [
      jax.tree.leaves(first_match([p], "config.scanned_layers", False)(params)) for p in patterns
  ]
  for pattern, mask in zip(patterns, masks):
    if not any(mask):
      raise ConfigError(
          f"config.scanned_layers regex {pattern!r} names no param; the names look like "
          f"{named[0][0]!r} (a regex fullmatches the whole name)"
      )
  stacked = [any(flags) for flags in zip(*masks)]
  for (name, x), flag in zip(named, stacked):
    if flag and len(x.shape) < 2:
      raise ConfigError(
          f"config.scanned_layers names {name!r} of shape {tuple(x.shape)}: a stack of layers "
          "has the layers on dim 0 and each layer's own dims after it; leave it out of the regex"
      )
  return jax.tree.unflatten(treedef, stacked)
