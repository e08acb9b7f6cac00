"""Meshes from big_vision's ``config.mesh``: a list of ``(axis_name, size)`` pairs.

At most one size may be ``-1`` (the rest of the devices). ``axis_types`` chooses how
the axes are typed: ``"auto"`` (the default: the compiler places what the plan does not
pin) or ``"explicit"`` (jax's "sharding in types", ``jax.make_mesh``'s default since jax
0.9: every array's sharding is part of its type, so params are gathered for compute
with :func:`bv_sharding.gather_for_compute`), one for all axes or one per axis (a
mixed mesh), as the strings or as ``jax.sharding.AxisType`` values. A plan accepts a
mesh of either kind, ``jax.make_mesh``'s included.

Multi-slice pods (MaxText's ``dcn_*`` idea): ``config.mesh`` is the mesh inside one
slice (ICI) and ``config.dcn_mesh`` the mesh across slices (DCN), a list of
``(axis_name, size)`` pairs over axes of ``config.mesh`` (an axis left out has
size 1; ``-1`` takes the rest of the slices). Each axis of the result is
``ici * dcn`` long, slices outermost, so traffic over an axis the DCN part does
not split stays inside a slice. The devices come from jax's
``mesh_utils.create_hybrid_device_mesh``, which needs devices with a
``slice_index`` (TPU multi-slice).

Example:
  >>> dict(make_mesh([("data", -1), ("model", 2)]).shape)  # the 8 simulated test devices
  {'data': 4, 'model': 2}
  >>> dict(make_abstract_mesh([("data", -1), ("model", 8)], 256).shape)  # no devices needed
  {'data': 32, 'model': 8}
  >>> dict(make_abstract_mesh([("data", -1), ("model", 4)], 512, dcn_mesh=[("data", 2)]).shape)
  {'data': 128, 'model': 4}
  >>> make_mesh([("data", -1), ("model", 2)], axis_types=("explicit", "auto")).axis_types
  (Explicit, Auto)
"""

import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AbstractMesh, AxisType, Mesh

from bv_sharding.errors import ShardingError, closest

AXIS_TYPES = {"auto": AxisType.Auto, "explicit": AxisType.Explicit}


def axis_sizes(
    config_mesh: Sequence, num_devices: int, key: str = "config.mesh"
) -> tuple[tuple[str, ...], tuple[int, ...]]:
  """Resolves ``config.mesh`` for ``num_devices`` into ``(names, sizes)``; ``key`` names it in errors.

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
  pairs = _pairs(config_mesh, key)
  names = tuple(name for name, _ in pairs)
  sizes = [size for _, size in pairs]
  if sizes.count(-1) > 1:
    raise ShardingError(
        f"{key} {list(pairs)} has more than one -1; at most one axis "
        "may take the rest of the devices"
    )
  known = math.prod(s for s in sizes if s != -1)
  if -1 in sizes:
    if num_devices % known:
      raise ShardingError(
          f"{key} {list(pairs)}: the fixed axes ({known} devices) do not "
          f"divide the {num_devices} devices; make {num_devices} a multiple"
      )
    sizes[sizes.index(-1)] = num_devices // known
  elif known != num_devices:
    raise ShardingError(
        f"{key} {list(pairs)} covers {known} devices but there are "
        f"{num_devices}; make the sizes multiply to {num_devices} or use -1 "
        "for one axis"
    )
  return names, tuple(sizes)


def axis_types_of(choice, names: Sequence[str]) -> tuple[AxisType, ...]:
  """One ``AxisType`` per axis of ``names`` from ``choice``: ``"auto"``, ``"explicit"``, an
  ``AxisType``, or a sequence of those with one per axis.

  Example:
    >>> axis_types_of("explicit", ("data", "model"))
    (Explicit, Explicit)
    >>> axis_types_of("explict", ("data",))
    Traceback (most recent call last):
    ...
    bv_sharding.errors.ShardingError: axis_types 'explict' for axes ('data',): use "auto" ...; did you mean 'explicit'?
  """
  choices = [choice] * len(names) if _one_type(choice) else choice
  try:
    types = tuple(_axis_type(c) for c in choices)
  except (TypeError, KeyError):
    types = ()
  if len(types) != len(names):
    hint = closest(choice, AXIS_TYPES) if isinstance(choice, str) else ""
    raise ShardingError(
        f'axis_types {choice!r} for axes {tuple(names)}: use "auto" or "explicit" (or '
        "jax.sharding.AxisType.Auto / .Explicit), one for all axes or one per axis" + hint
    )
  return types


def _one_type(choice) -> bool:
  return isinstance(choice, (str, AxisType))


def _axis_type(choice) -> AxisType:
  if choice in (AxisType.Auto, AxisType.Explicit):
    return choice
  if not isinstance(choice, str):
    raise TypeError(choice)
  return AXIS_TYPES[choice]


def make_mesh(
    config_mesh: Sequence,
    devices: Sequence | None = None,
    dcn_mesh: Sequence | None = None,
    axis_types="auto",
) -> Mesh:
  """A ``Mesh`` over ``devices`` (default: all of ``jax.devices()``), its axes typed by
  ``axis_types`` (module docstring).

  With ``dcn_mesh`` (``config.dcn_mesh``), a hybrid ICI x DCN mesh over TPU slices.
  """
  devices = jax.devices() if devices is None else list(devices)
  if dcn_mesh:
    names, array = hybrid_devices(config_mesh, dcn_mesh, devices)
    return Mesh(array, names, axis_types=axis_types_of(axis_types, names))
  names, sizes = axis_sizes(config_mesh, len(devices))
  return jax.make_mesh(sizes, names, axis_types=axis_types_of(axis_types, names), devices=devices)


def make_abstract_mesh(
    config_mesh: Sequence,
    num_devices: int,
    dcn_mesh: Sequence | None = None,
    num_slices: int | None = None,
    axis_types="auto",
) -> AbstractMesh:
  """An ``AbstractMesh`` for planning ``num_devices`` without having them, its axes typed
  by ``axis_types`` as in :func:`make_mesh`.

  With ``dcn_mesh``, ``num_devices`` spans ``num_slices`` slices (default: the
  product of the ``dcn_mesh`` sizes, which then may not hold a ``-1``) and each
  axis is ``ici * dcn`` long, as :func:`make_mesh` builds it on the pod.
  """
  if not dcn_mesh:
    names, sizes = axis_sizes(config_mesh, num_devices)
  else:
    names, sizes = _hybrid_sizes(config_mesh, dcn_mesh, num_devices, num_slices)
  return AbstractMesh(sizes, names, axis_types=axis_types_of(axis_types, names))


def hybrid_devices(
    config_mesh: Sequence, dcn_mesh: Sequence, devices: Sequence
) -> tuple[tuple[str, ...], np.ndarray]:
  """``(names, device array)`` of the hybrid ICI x DCN mesh over ``devices``' slices.

  Raises ``ShardingError`` where the devices have no ``slice_index`` (CPU, GPU,
  one TPU slice without it) or do not split as the two meshes ask.
  """
  missing = next((d for d in devices if getattr(d, "slice_index", None) is None), None)
  if missing is not None:
    raise ShardingError(
        f"config.dcn_mesh {dcn_mesh!r} needs devices in TPU slices, but device "
        f"{missing} ({missing.platform}) has no slice_index; drop config.dcn_mesh to use "
        "config.mesh alone (one slice, CPU or GPU)"
    )
  num_slices = len({d.slice_index for d in devices})
  names, ici, dcn = _split_sizes(config_mesh, dcn_mesh, len(devices), num_slices)
  try:
    array = mesh_utils.create_hybrid_device_mesh(ici, dcn, devices, allow_split_physical_axes=True)
  except (ValueError, AssertionError, NotImplementedError) as e:
    raise ShardingError(
        f"config.mesh {config_mesh!r} (per slice {dict(zip(names, ici))}) with "
        f"config.dcn_mesh {dcn_mesh!r} (across slices {dict(zip(names, dcn))}) does "
        f"not fit the {len(devices)} devices in {num_slices} slices: {e}"
    ) from None
  return names, array


def _hybrid_sizes(config_mesh, dcn_mesh, num_devices, num_slices):
  """``(names, ici * dcn sizes)`` for ``num_devices`` in ``num_slices`` slices."""
  if num_slices is None:
    _, dcn_pairs = _aligned_dcn(config_mesh, dcn_mesh)
    if any(size == -1 for _, size in dcn_pairs):
      raise ShardingError(
          f"config.dcn_mesh {dcn_mesh!r} has a -1: say how many slices to plan for "
          "(num_slices) or give every size"
      )
    num_slices = math.prod(size for _, size in dcn_pairs)
  names, ici, dcn = _split_sizes(config_mesh, dcn_mesh, num_devices, num_slices)
  return names, tuple(i * d for i, d in zip(ici, dcn))


def _split_sizes(config_mesh, dcn_mesh, num_devices, num_slices):
  """``(names, ici sizes, dcn sizes)``: ``config.mesh`` per slice, ``dcn_mesh`` across slices."""
  if num_devices % num_slices:
    raise ShardingError(
        f"{num_devices} devices do not split into {num_slices} equal slices for "
        f"config.dcn_mesh {dcn_mesh!r}"
    )
  names, dcn_pairs = _aligned_dcn(config_mesh, dcn_mesh)
  _, ici = axis_sizes(config_mesh, num_devices // num_slices)
  _, dcn = axis_sizes(dcn_pairs, num_slices, key="config.dcn_mesh")
  return names, ici, dcn


def _aligned_dcn(config_mesh, dcn_mesh):
  """``config.mesh``'s names and ``dcn_mesh`` as one pair per mesh axis (size 1 if left out)."""
  names = tuple(name for name, _ in _pairs(config_mesh))
  dcn = dict(_pairs(dcn_mesh, "config.dcn_mesh"))
  unknown = [name for name in dcn if name not in names]
  if unknown:
    raise ShardingError(
        f"config.dcn_mesh {dcn_mesh!r} names axis {unknown[0]!r}, which config.mesh "
        f"does not have; use axes of {list(names)}"
    )
  return names, tuple((name, dcn.get(name, 1)) for name in names)


def _pairs(config_mesh, key: str = "config.mesh") -> tuple[tuple[str, int], ...]:
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
        f"{key} must be a non-empty list of (axis_name, size) pairs with "
        f'sizes > 0 or -1, e.g. [("data", -1), ("model", 2)]; got {config_mesh!r}'
    )
  names = [n for n, _ in pairs]
  if len(set(names)) != len(names):
    raise ShardingError(f"{key} {list(pairs)} names an axis twice; axis names must be unique")
  return pairs
