"""Meshes from big_vision's ``config.mesh``: a list of ``(axis_name, size)`` pairs.

At most one size may be ``-1`` (the rest of the devices). Axes are ``Auto``:
``jax.make_mesh`` defaults to Explicit axes in jax 0.10, under which common
optimizer code raises ``ShardingTypeError``.

Example:
  >>> dict(make_mesh([("data", -1), ("model", 2)]).shape)  # the 8 simulated test devices
  {'data': 4, 'model': 2}
  >>> dict(make_abstract_mesh([("data", -1), ("model", 8)], 256).shape)  # no devices needed
  {'data': 32, 'model': 8}
"""

import math
from collections.abc import Sequence

import jax
from jax.sharding import AbstractMesh, AxisType, Mesh

from bv_sharding.errors import ShardingError


def axis_sizes(config_mesh: Sequence, num_devices: int) -> tuple[tuple[str, ...], tuple[int, ...]]:
  """Resolves ``config.mesh`` for ``num_devices`` into ``(names, sizes)``.

  Example:
    >>> axis_sizes([("data", -1), ("model", 2)], 8)
    (('data', 'model'), (4, 2))
    >>> axis_sizes([("data", -1)], 0)
    Traceback (most recent call last):
    ...
    bv_sharding.errors.ShardingError: num_devices=0: a mesh needs a whole number of devices >= 1, e.g. 8
  """
  if isinstance(num_devices, bool) or not isinstance(num_devices, int) or num_devices < 1:
    raise ShardingError(
        f"num_devices={num_devices!r}: a mesh needs a whole number of devices >= 1, e.g. 8"
    )
  pairs = _pairs(config_mesh)
  names = tuple(name for name, _ in pairs)
  sizes = [size for _, size in pairs]
  if sizes.count(-1) > 1:
    raise ShardingError(
        f"config.mesh {list(pairs)} has more than one -1; at most one axis "
        "may take the rest of the devices"
    )
  known = math.prod(s for s in sizes if s != -1)
  if -1 in sizes:
    if num_devices % known:
      raise ShardingError(
          f"config.mesh {list(pairs)}: the fixed axes ({known} devices) do not "
          f"divide the {num_devices} devices; make {num_devices} a multiple"
      )
    sizes[sizes.index(-1)] = num_devices // known
  elif known != num_devices:
    raise ShardingError(
        f"config.mesh {list(pairs)} covers {known} devices but there are "
        f"{num_devices}; make the sizes multiply to {num_devices} or use -1 "
        "for one axis"
    )
  return names, tuple(sizes)


def make_mesh(config_mesh: Sequence, devices: Sequence | None = None) -> Mesh:
  """A ``Mesh`` with Auto axes over ``devices`` (default: all of ``jax.devices()``)."""
  devices = jax.devices() if devices is None else list(devices)
  names, sizes = axis_sizes(config_mesh, len(devices))
  return jax.make_mesh(sizes, names, axis_types=(AxisType.Auto,) * len(names), devices=devices)


def make_abstract_mesh(config_mesh: Sequence, num_devices: int) -> AbstractMesh:
  """An ``AbstractMesh`` for planning ``num_devices`` without having them."""
  names, sizes = axis_sizes(config_mesh, num_devices)
  return AbstractMesh(sizes, names, axis_types=(AxisType.Auto,) * len(names))


def _pairs(config_mesh) -> tuple[tuple[str, int], ...]:
  try:
    pairs = tuple((name, size) for name, size in config_mesh)
  except (TypeError, ValueError):
    pairs = ()
  ok = pairs and all(
      isinstance(n, str)
      and n
      and isinstance(s, int)
      and not isinstance(s, bool)
      and (s > 0 or s == -1)
      for n, s in pairs
  )
  if not ok:
    raise ShardingError(
        f"config.mesh must be a non-empty list of (axis_name, size) pairs with "
        f'sizes > 0 or -1, e.g. [("data", -1), ("model", 2)]; got {config_mesh!r}'
    )
  names = [n for n, _ in pairs]
  if len(set(names)) != len(names):
    raise ShardingError(f"config.mesh {list(pairs)} names an axis twice; axis names must be unique")
  return pairs
