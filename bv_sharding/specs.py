"""Per-dimension specs and the one safe way to put a mesh axis on a dim.

A spec is a tuple with one entry per array dim: ``None`` (replicated), a mesh
axis name, or a tuple of mesh axis names. Rules never build specs by hand: they
call :func:`place`, which refuses anything ``jax.jit`` would reject (an axis used
twice, a dim that is taken or not divisible) and says why.

Example:
  >>> leaf = Leaf("w", (8, 6), np.dtype("float32"), mesh={"data": 4})
  >>> place(leaf, (None, None), 0, "data")
  ((\'data\', None), 'dim 0 over data')
  >>> place(leaf, (None, None), 1, "data")[1]
  'dim 1 (6) not divisible by data (4)'
"""

import dataclasses
import math
from typing import Any

import numpy as np

from bv_sharding.errors import ShardingError

Axis = str | tuple[str, ...]
Spec = tuple[Axis | None, ...]
MiB = 2**20


@dataclasses.dataclass(frozen=True)
class Leaf:
  """What a rule sees of one leaf.

  ``names``/``logical`` come from a flax box (``nn.Partitioned`` mesh axis names,
  or ``nn.LogicallyPartitioned`` logical names); ``rules`` are the logical axis
  rules; ``strict`` turns an indivisible requested dim into an error; ``state``
  marks optimizer state (leaves outside ``params``) and ``follow`` is its
  :class:`bv_sharding.following.Follow` when it belongs to a param.
  """

  name: str
  shape: tuple[int, ...]
  dtype: np.dtype
  mesh: dict[str, int] = dataclasses.field(default_factory=dict)
  names: tuple | None = None
  logical: bool = False
  rules: tuple = ()
  strict: bool = False
  state: bool = False
  follow: Any = None

  @property
  def ndim(self) -> int:
    return len(self.shape)

  @property
  def nbytes(self) -> int:
    return math.prod(self.shape) * self.dtype.itemsize

  @property
  def components(self) -> tuple[str, ...]:
    return tuple(self.name.split("/"))


def axes_of(entry: Axis | None) -> tuple[str, ...]:
  """Mesh axes in one spec entry: ``None -> ()``, ``"a" -> ("a",)``."""
  if entry is None:
    return ()
  return (entry,) if isinstance(entry, str) else tuple(entry)


def axis_size(mesh: dict[str, int], axis: Axis | None) -> int:
  """Number of shards ``axis`` (one name or a tuple) makes on ``mesh``."""
  return math.prod(mesh[a] for a in axes_of(axis))


def used_axes(spec: Spec) -> set[str]:
  return {a for entry in spec for a in axes_of(entry)}


def shards(spec: Spec, mesh: dict[str, int]) -> int:
  """How many pieces ``spec`` cuts an array into."""
  return math.prod(axis_size(mesh, e) for e in spec)


def check_axis(op: str, axis: Any) -> Axis:
  """Validates an op's ``axis`` argument: a mesh axis name or a non-empty tuple of them."""
  if isinstance(axis, str) and axis:
    return axis
  if isinstance(axis, (tuple, list)) and axis and all(isinstance(a, str) and a for a in axis):
    if len(set(axis)) != len(axis):
      raise ShardingError(f"{op}: axis {tuple(axis)!r} names a mesh axis twice")
    return tuple(axis)
  raise ShardingError(
      f"{op}: axis must be a mesh axis name or a tuple of names, "
      f'e.g. axis="data" or axis=("data", "model"); got {axis!r}'
  )


def check_number(op: str, name: str, value: Any) -> float:
  """``value`` once it is a finite number >= 0 (``1e999`` reads as infinity: refused).

  Example:
    >>> check_number("fsdp", "min_size_to_shard_mb", 4)
    4
  """
  numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
  if not numeric or not 0 <= value < math.inf:
    raise ShardingError(f"{op}: {name} must be a finite number >= 0, got {value!r}")
  return value


def normalize_dim(leaf: Leaf, dim: int) -> int | None:
  """``dim`` as a non-negative index into ``leaf.shape``, or ``None`` when out of range."""
  return dim + leaf.ndim if -leaf.ndim <= dim < 0 else (dim if 0 <= dim < leaf.ndim else None)


def place(leaf: Leaf, spec: Spec, dim: int, axis: Axis, requested: bool = True) -> tuple[Spec, str]:
  """Puts ``axis`` on ``dim`` of ``spec`` if ``jax.jit`` would accept it.

  Returns the new spec and a note; when the axis cannot go there, the spec is
  returned unchanged and the note says why. ``requested`` marks a dim the config
  asked for by name: under ``leaf.strict`` an indivisible one raises.
  """
  missing = [a for a in axes_of(axis) if a not in leaf.mesh]
  if missing:
    raise ShardingError(
        f"leaf {leaf.name!r}: the mesh has no axis {missing[0]!r}; its axes are "
        f"{list(leaf.mesh)}. Fix the strategy, the sharding_rules or config.mesh."
    )
  index = normalize_dim(leaf, dim)
  if index is None:
    return _refuse(leaf, spec, f"dim {dim} out of range for shape {leaf.shape}", requested)
  if spec[index] is not None:
    return spec, f"dim {index} already over {spec[index]}"
  clash = used_axes(spec) & set(axes_of(axis))
  if clash:
    return spec, f"{'/'.join(sorted(clash))} already used by this leaf"
  size = axis_size(leaf.mesh, axis)
  if leaf.shape[index] % size:
    return _refuse(
        leaf,
        spec,
        f"dim {index} ({leaf.shape[index]}) not divisible by " f"{_show(axis)} ({size})",
        requested,
    )
  new = spec[:index] + (axis,) + spec[index + 1 :]
  return new, f"dim {index} over {_show(axis)}"


def place_largest(leaf: Leaf, spec: Spec, axis: Axis, dims=None) -> tuple[Spec, str]:
  """Puts ``axis`` on the largest free dim it divides (ties: the last), among ``dims``."""
  dims = range(leaf.ndim) if dims is None else dims
  order = sorted(dims, key=lambda i: (leaf.shape[i], i), reverse=True)
  if used_axes(spec) & set(axes_of(axis)):
    return spec, f"{_show(axis)} already used by this leaf"
  for index in order:
    if spec[index] is None and leaf.shape[index] % axis_size(leaf.mesh, axis) == 0:
      return place(leaf, spec, index, axis)
  return _refuse(
      leaf,
      spec,
      f"no free dim of {leaf.shape} divisible by {_show(axis)} " f"({axis_size(leaf.mesh, axis)})",
      requested=bool(order),
  )


def checked(op: str, result: Any, leaf: Leaf) -> tuple[Spec, str]:
  """``result`` of op ``op``'s rule on ``leaf`` if it is a valid ``(spec, note)``, else raises.

  A valid spec has one entry per dim, each ``None``, a mesh axis or a tuple of mesh axes;
  no axis twice; every dim divisible by its axes' size.

  Example:
    >>> leaf = Leaf("w", (8, 6), np.dtype("float32"), mesh={"data": 4})
    >>> checked("my_op", ((None, None), "kept"), leaf)
    ((None, None), 'kept')
    >>> checked("my_op", ("data",), leaf)
    Traceback (most recent call last):
    ...
    bv_sharding.errors.ShardingError: op 'my_op' on leaf 'w' (8, 6) returned ('data',); a rule must return (spec, note): a tuple of 2 entries (None, a mesh axis of ['data'] or a tuple of them) and a string, built with bv_sharding.ops.place
  """
  ok = isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], str)
  spec = result[0] if ok else None
  if ok and isinstance(spec, tuple) and len(spec) == leaf.ndim:
    entries = [axes_of(e) if e is None or isinstance(e, (str, tuple)) else None for e in spec]
    flat = [a for e in entries if e is not None for a in e]
    ok = (
        None not in entries
        and all(isinstance(a, str) and a in leaf.mesh for a in flat)
        and len(set(flat)) == len(flat)
        and all(n % axis_size(leaf.mesh, e) == 0 for n, e in zip(leaf.shape, spec))
    )
  else:
    ok = False
  if not ok:
    raise ShardingError(
        f"op {op!r} on leaf {leaf.name!r} {leaf.shape} returned {result!r}; a rule must return "
        f"(spec, note): a tuple of {leaf.ndim} entries (None, a mesh axis of {list(leaf.mesh)} "
        "or a tuple of them) and a string, built with bv_sharding.ops.place"
    )
  return result


def too_small(leaf: Leaf, min_size_mb: float, inclusive: bool = False) -> str | None:
  """A note when ``leaf`` is under the ``min_size_mb`` threshold (or at it, when
  ``inclusive``: big_vision's ``fsdp`` shards only leaves above it), else ``None``."""
  if leaf.nbytes < min_size_mb * MiB or (inclusive and leaf.nbytes == min_size_mb * MiB):
    sign = "<=" if inclusive else "<"
    return f"{leaf.nbytes / MiB:.3g} MiB {sign} {min_size_mb:g} MiB threshold"
  return None


def _refuse(leaf: Leaf, spec: Spec, why: str, requested: bool) -> tuple[Spec, str]:
  if leaf.strict and requested:
    raise ShardingError(
        f"leaf {leaf.name!r} {leaf.shape}: {why}. Change the mesh or the "
        "model dims, pick another dim, or plan with strict=False to leave it "
        "unsharded."
    )
  return spec, why


def _show(axis: Axis) -> str:
  return axis if isinstance(axis, str) else "(" + ",".join(axis) + ")"
