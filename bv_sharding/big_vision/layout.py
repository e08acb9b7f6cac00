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
its blocks gathered to this layout.

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

from bv_sharding.errors import ShardingWarning
from bv_sharding.mesh import axis_sizes
from bv_sharding.optimizers.layout import ParamLayout
from bv_sharding.planning import plan

__all__ = ["DEFAULT_RULES", "DEFAULT_STRATEGY", "layout_of", "mesh_of"]

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
  train state's own plan.
  """
  strategy = config.get("sharding_strategy") or list(DEFAULT_STRATEGY)
  rules = config.get("sharding_rules") or list(DEFAULT_RULES)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", ShardingWarning)
    params_plan = plan({"params": params}, strategy, mesh_of(config), rules=rules)
  return ParamLayout.from_plan(params_plan)
