"""Blocks on the params' layout: where each param's shards live, and the tiles they hold.

Kron and Shampoo precondition blocks of a param. Left to XLA, a block that spans several
devices' shards makes every factor update gather, transpose and scatter. Given the param
layout (the plan's specs and the mesh) through :class:`ParamLayout`, they compute each
block where its data is:

* dim ``k`` of a param with ``s_k`` shards has local extent ``e_k = d_k / s_k``; when
  it is a multiple of ``block_size`` (or the dim is not split) each shard holds whole
  tiles; shard-local blocks (``blocking="local"``) are ``min(block_size, e_k)`` long, a
  local extent that is not a multiple zero-padded inside its shard (a padded block acts
  like a smaller one);
* blocks are stacked shard-major (shards in row-major order over the param's dims,
  then each shard's blocks as :func:`~bv_sharding.optimizers.tensor_ops.blockify`
  orders them), so splitting the stack's dim 0 over
  :func:`bv_sharding.ops.stack_axes` gives each device the blocks of its own
  shard, which is where the plan puts them;
* on a concrete ``Mesh`` the per-block work runs in ``jax.shard_map`` over the param's
  spec: no collective but the scalars computed outside it (norms, counters). On an
  ``AbstractMesh`` (or without a layout) the same blocks are computed on global
  arrays: the unsharded reference, and shapes for planning.

Same math on any mesh (``blocking="tiles"``, the default): the blocks are the param's own
grid of ``block_size`` tiles whatever the device count; where a tile spans several shards
its holders exchange what it needs (:attr:`ShardBlocks.owners`) or it is pooled with other
params' tiles and dealt over the mesh (:attr:`ShardBlocks.pooled`, :func:`run_all`); a pool
whose padding to the device count is small has its stacks stored as one, where they are
fitted (:func:`stored_pools`, :func:`pack`). Between meshes only the order of the stacks and
which pools are stored as one differ (:func:`reorder`, :func:`stack_runs`).
``blocking="local"`` keeps blocks cut shard by shard: ``min(block_size, e_k)`` long, so
another mesh may give other tiles. :func:`same_blocking` tells whether two layouts give
the same tiles; when they do not, the factors of one layout do not fit the other's blocks
and a restore onto that mesh must re-initialise them.

Example:
    >>> blocks = ShardBlocks((8, 6), (2, 1), block_size=2)
    >>> blocks.local_shape, blocks.count, blocks.sizes
    ((4, 6), 12, (2, 2))
    >>> x = jnp.arange(48.0).reshape(8, 6)
    >>> stack = blocks.split(x)
    >>> stack.shape, bool((blocks.merge(stack) == x).all())
    ((12, 2, 2), True)
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from bv_sharding.errors import OptimizerError
from bv_sharding.ops import axis_size, stack_axes
from bv_sharding.optimizers.axes import auto_mesh
from bv_sharding.optimizers.state_dtype import compute_dtype
from bv_sharding.optimizers.tensor_ops import blockify, unblockify

BLOCKINGS = ("tiles", "local")  # The param's fixed tile grid (default), or each shard's own blocks.

# While :func:`stack_blocks` traces an update: the (blocks, stacks) each ShardBlocks.run got.
_RUNS = contextvars.ContextVar("shard_block_runs", default=None)


@dataclasses.dataclass(frozen=True)
class ParamLayout:
  """How params are sharded: ``specs`` (a ``PartitionSpec`` per param leaf) on ``mesh``.

  ``mesh`` is a ``jax.sharding.Mesh`` (the optimizer runs its blocks in
  ``shard_map``) or an ``AbstractMesh`` (same blocks, computed on global arrays).
  A training loop builds it from the plan of the params with :meth:`from_plan`. The mesh
  is kept with Auto axes (:func:`~bv_sharding.optimizers.axes.auto_mesh`): the registry's
  updates run in Auto axes on any mesh (``axes.py``).

  Example:
      >>> mesh = jax.sharding.AbstractMesh((4,), ("data",))
      >>> layout = ParamLayout({"w": P("data", None)}, mesh)
      >>> layout.blocks_of({"w": jnp.ones((8, 6))}, 2)["w"].count
      12
  """

  specs: Any
  mesh: Any

  def __post_init__(self):
    object.__setattr__(self, "mesh", auto_mesh(self.mesh))

  @classmethod
  def from_plan(cls, plan) -> ParamLayout:
    """The layout of a ``bvs.Plan`` made over ``{"params": abstract_params}``."""
    return cls(plan.specs["params"], plan.mesh)

  @classmethod
  def from_record(cls, record: dict, params) -> ParamLayout:
    """The layout a :meth:`record` describes, on an ``AbstractMesh``, for ``params``' tree."""
    names, sizes = zip(*record["mesh"]) if record["mesh"] else ((), ())
    specs = [P(*(tuple(e) if isinstance(e, list) else e for e in spec)) for spec in record["specs"]]
    mesh = jax.sharding.AbstractMesh(tuple(sizes), tuple(names))
    return cls(jax.tree.structure(params).unflatten(specs), mesh)

  def record(self) -> dict:
    """JSON-able ``{"mesh": [[axis, size], ...], "specs": [spec per param leaf]}``.

    Example:
        >>> mesh = jax.sharding.AbstractMesh((4,), ("data",))
        >>> layout = ParamLayout({"w": P("data", None), "b": P()}, mesh)
        >>> layout.record()
        {'mesh': [['data', 4]], 'specs': [[], ['data', None]]}
    """
    specs = jax.tree.leaves(self.specs, is_leaf=lambda x: isinstance(x, P))
    entry = lambda e: list(e) if isinstance(e, tuple) else e
    return {
        "mesh": [[name, size] for name, size in dict(self.mesh.shape).items()],
        "specs": [[entry(e) for e in spec] for spec in specs],
    }

  def blocks_of(self, params, block_size: int, scanned=None, blocking: str = "tiles") -> Any:
    """A :class:`ShardBlocks` per leaf of ``params`` (``scanned``: a bool per leaf)."""
    scanned = jax.tree.map(lambda _: False, params) if scanned is None else scanned
    treedef = jax.tree.structure(params)
    leaves = zip(treedef.flatten_up_to(params), treedef.flatten_up_to(self.specs))
    blocks = [
        shard_blocks(x.shape, spec, self.mesh, block_size, s, blocking=blocking)
        for (x, spec), s in zip(leaves, treedef.flatten_up_to(scanned))
    ]
    return treedef.unflatten(blocks)


def shard_blocks(
    shape,
    spec,
    mesh,
    block_size: int,
    scanned: bool = False,
    deal: bool = False,
    blocking: str = "tiles",
) -> ShardBlocks:
  """The :class:`ShardBlocks` of a param of ``shape`` sharded as ``spec`` on ``mesh``.

  ``deal``: a param no mesh axis splits is blocked as if its largest dim that the
  device count divides were split over every mesh axis, and each device works on its
  own piece (:attr:`ShardBlocks.dealt`) where the pieces hold whole tiles (always under
  ``"local"``); otherwise, under ``"tiles"``, its tiles are pooled
  (:attr:`ShardBlocks.pooled`); when no dim divides, its blocks are computed on global
  arrays.

  ``blocking``: ``"tiles"`` (the param's fixed grid of ``block_size`` tiles, whatever
  the mesh: shard-local where every shard holds whole tiles, :func:`tiles_in_shards`;
  else dealt to owners among each tile's holders, or pooled with other params' tiles and
  dealt over the mesh: :attr:`ShardBlocks.owners`, :attr:`ShardBlocks.pooled`) or
  ``"local"`` (each shard
  cut into its own blocks of ``min(block_size, local extent)``: no collective, the math
  depends on the mesh).

  Example:
      >>> mesh = jax.sharding.AbstractMesh((2, 2), ("data", "model"))
      >>> shard_blocks((8, 6), P("data", "model"), mesh, 4, blocking="local").shards
      (2, 2)
      >>> shard_blocks((8, 6), P("data", "model"), mesh, 4).pooled  # 3 of a 4-tile's 6 columns
      True
      >>> dealt = shard_blocks((8,), P(), mesh, 2, deal=True)  # 2-tiles: one per device
      >>> dealt.dealt, dealt.shards, dealt.stack_spec
      (True, (4,), P(('data', 'model'),))
  """
  if blocking not in BLOCKINGS:
    raise OptimizerError(f"blocking={blocking!r}; expected one of {BLOCKINGS}")
  spec = tuple(spec) + (None,) * (len(shape) - len(tuple(spec)))
  sizes = dict(mesh.shape) if mesh is not None else {}
  dim = _deal_dim(shape, sizes, scanned) if deal and not stack_axes(spec) else None
  shards_of = lambda spec: tuple(axis_size(sizes, entry) for entry in spec)
  dealt = None if dim is None else _dealt_spec(len(shape), dim, sizes)
  in_pieces = dealt is not None and (
      blocking == "local" or tiles_in_shards(shape, shards_of(dealt), block_size, scanned)
  )
  spec = dealt if in_pieces else spec
  owners, pooled = None, False
  if blocking == "tiles":
    whole = _whole_tiles(shape, shards_of(spec), block_size, scanned)
    owners = _owners(tuple(shape), spec, shards_of(spec), whole, block_size, scanned)
    # Tiles that span shards and no holder owns, or that a dealt piece would cut: pooled.
    pooled = owners is None and (not all(whole) or (dealt is not None and not in_pieces))
  shards = (1,) * len(shape) if pooled else shards_of(spec)
  concrete = isinstance(mesh, jax.sharding.Mesh) and (math.prod(shards) > 1 or pooled)
  return ShardBlocks(
      tuple(shape),
      shards,
      block_size,
      scanned,
      spec,
      mesh if concrete else None,
      in_pieces,
      owners,
      pooled,
      math.prod(sizes.values()) if pooled else 1,
  )


def _owners(shape, spec, shards, whole, block_size: int, scanned: bool):
  """``(dim, axis, holders)`` when the tiles of one dim span ``holders`` whole shards of one
  mesh axis and every shard's pieces of tiles deal evenly to those holders; else None."""
  spanning = [k for k, w in enumerate(whole) if not w]
  axes = stack_axes((spec[spanning[0]],)) if len(spanning) == 1 else ()
  if len(axes) != 1:
    return None
  k = spanning[0]
  extent, tile = shape[k] // shards[k], min(block_size, shape[k])
  if tile % extent or shape[k] % tile:
    return None
  holders = tile // extent
  pieces = ShardBlocks(shape, shards, block_size, scanned).count // math.prod(shards)
  return (k, axes[0], holders) if pieces % holders == 0 else None


def tiles_in_shards(shape, shards, block_size: int, scanned: bool = False) -> bool:
  """Whether every shard holds whole ``block_size`` tiles of the param (its fixed grid).

  True when each split dim (not a scanned layer axis) has a local extent that is a
  multiple of ``block_size``: the blocks cut shard by shard are then the param's tiles.

  Example:
      >>> tiles_in_shards((512, 256), (2, 1), 128), tiles_in_shards((512, 256), (8, 1), 128)
      (True, False)
  """
  return all(_whole_tiles(shape, shards, block_size, scanned))


def _whole_tiles(shape, shards, block_size: int, scanned: bool) -> list[bool]:
  """Per dim: whether its shards hold whole tiles (a scanned layer axis always does)."""
  return [
      (scanned and i == 0) or s == 1 or (d // s) % block_size == 0
      for i, (d, s) in enumerate(zip(shape, shards))
  ]


def _deal_dim(shape, sizes: dict[str, int], scanned: bool) -> int | None:
  """The largest dim (not a scanned layer axis) the device count divides, if any."""
  devices = math.prod(sizes.values())
  dims = [d for d in range(int(scanned), len(shape)) if devices > 1 and shape[d] % devices == 0]
  return max(dims, key=lambda d: shape[d], default=None)


def _dealt_spec(ndim: int, dim: int, sizes: dict[str, int]) -> tuple:
  """A never-sharded param's virtual spec: its blocks' stack axes on its deal ``dim``."""
  axes = stack_axes((), sizes)
  spec = [None] * ndim
  spec[dim] = _entry(axes)
  return tuple(spec)


@dataclasses.dataclass(frozen=True)
class ShardBlocks:
  """One param's shard-local blocking: ``shards`` per dim, blocks of ``block_size``.

  ``scanned``: dim 0 is a layer axis, blocked layer by layer (never cut).
  ``spec``/``mesh``: where to run :meth:`run` in ``shard_map`` (``mesh`` None:
  on global arrays). ``dealt``: the param is replicated and ``spec`` is virtual:
  every device holds the whole param, cuts it as ``spec`` would shard it and works
  on its own piece's blocks; the pieces' results are gathered (a param's bytes).
  ``owners``: ``(dim, axis, holders)`` (``blocking="tiles"``): the tiles of ``dim``
  span ``holders`` consecutive shards of ``axis``, and each of those holders *owns* an
  equal share of the tiles they hold together: its stack slice holds their factors, the
  holders exchange the tiles' pieces (an all-to-all among them) so that each owner fits
  and applies its whole tiles, and send the directions' pieces back the same way.
  ``pooled``: where no such split exists (fewer tiles than holders, or tiles not aligned
  with the shards), the blocks are the param's global tile grid (``shards`` all 1, the
  one-device order) and :func:`run_all` pools them with the other pooled params' tiles of
  the same shape into one stack split over every mesh axis: each device fits and applies
  its ``1/N`` of all those tiles. XLA moves each array (a device's shard to its tiles'
  owners, and back) with all-to-alls and collective permutes of about a shard's bytes. The
  stacks of a pool :func:`stored_pools` keeps are stored as one, each device's slice the
  factors it fits (nothing moves); the others per param at the ideal (:func:`stack_specs`),
  moving the same way as the arrays.
  On an ``AbstractMesh`` (``mesh`` None) the same tiles are computed on global arrays, and
  the stacks are placed as on the concrete mesh.
  """

  shape: tuple[int, ...]
  shards: tuple[int, ...]
  block_size: int
  scanned: bool = False
  spec: tuple = ()
  mesh: Any = None
  dealt: bool = False
  owners: tuple[int, str, int] | None = None
  pooled: bool = False
  devices: int = 1

  @property
  def in_pool(self) -> bool:
    """Whether :func:`run_all` pools these blocks (pooled, on a concrete mesh)."""
    return self.pooled and self.mesh is not None

  @property
  def local_shape(self) -> tuple[int, ...]:
    return tuple(d // s for d, s in zip(self.shape, self.shards))

  @property
  def whole_tiles(self) -> ShardBlocks:
    """With :attr:`owners`: the same tiles cut from shards of whole tiles (one per group
    of holders), stacked in that blocking's order; else ``self``."""
    if self.owners is None:
      return self
    dim, _, holders = self.owners
    shards = tuple(s // holders if d == dim else s for d, s in enumerate(self.shards))
    return dataclasses.replace(self, shards=shards, mesh=None, owners=None)

  @property
  def sizes(self) -> tuple[int, ...]:
    """Block size per (per-layer) dim."""
    if self.owners is not None:
      return self.whole_tiles.sizes
    local = self.local_shape[1:] if self.scanned else self.local_shape
    return tuple(min(e, self.block_size) for e in local)

  @property
  def count(self) -> int:
    """Number of blocks in the whole stack."""
    if self.owners is not None:
      return self.whole_tiles.count
    local = self.local_shape[1:] if self.scanned else self.local_shape
    per_shard = math.prod(-(-e // b) for e, b in zip(local, self.sizes))
    layers = self.local_shape[0] if self.scanned else 1
    return math.prod(self.shards) * layers * per_shard

  @property
  def stack_spec(self) -> P:
    """Spec of dim 0 of a block stack: split over the param's axes (shard-major)."""
    axes = stack_axes(self.spec)
    return P(_entry(axes)) if axes else P()

  def tiles(self) -> tuple[tuple[int, ...], ...]:
    """Per dim, the sorted start offsets of the blocks in the param (padding aside)."""
    if self.owners is not None:
      return self.whole_tiles.tiles()
    starts = []
    for dim, (extent, shards) in enumerate(zip(self.local_shape, self.shards)):
      if self.scanned and dim == 0:
        continue
      b = min(extent, self.block_size)
      starts.append(tuple(k * extent + j for k in range(shards) for j in range(0, extent, b)))
    return tuple(starts)

  def split(self, x: jax.Array, local: bool = False) -> jax.Array:
    """Param-shaped ``x`` (or its local shard) as the block stack ``(n, *sizes)``.

    With :attr:`owners` the global stack is in owner order (each device's owned tiles in
    turn) and a local shard's stack holds its pieces of tiles, ``min(block_size, extent)``.
    """
    if self.owners is not None and not local:
      return self._owner_order(self.whole_tiles.split(x))
    shards = self._grid(x, local)
    per_shard = blockify(x, tuple(d // s for d, s in zip(x.shape, shards)))
    cut = functools.partial(blockify, block_size=self.block_size)
    if self.scanned:
      cut = jax.vmap(cut)
    blocks = jax.vmap(cut)(per_shard)
    return blocks.reshape(-1, *blocks.shape[-len(self.sizes) :])

  def merge(self, blocks: jax.Array, local: bool = False) -> jax.Array:
    """Inverse of :meth:`split`."""
    if self.owners is not None and not local:
      return self.whole_tiles.merge(self._owner_order(blocks, inverse=True))
    shape = self.local_shape if local else self.shape
    shards = (1,) * len(shape) if local else self.shards
    local_shape = self.local_shape
    per_layer = local_shape[1:] if self.scanned else local_shape
    glue = functools.partial(unblockify, shape=per_layer, block_size=self.block_size)
    if self.scanned:
      glue = jax.vmap(glue)
      blocks = blocks.reshape(math.prod(shards), local_shape[0], -1, *blocks.shape[1:])
    else:
      blocks = blocks.reshape(math.prod(shards), -1, *blocks.shape[1:])
    return unblockify(jax.vmap(glue)(blocks), shape, local_shape)

  def run(
      self,
      fn: Callable,
      arrays: Sequence[jax.Array],
      stacks: Any,
      scalars: Sequence[jax.Array] = (),
  ) -> tuple[list[jax.Array], Any]:
    """``fn(block_stacks, stacks, *scalars) -> (out_block_stacks, new_stacks)`` per shard.

    ``arrays`` are param-shaped and split into blocks for ``fn``; its outputs are
    merged back to param shape. ``stacks`` (a pytree of block stacks, e.g. factors)
    go in and out as they are. On a mesh this is a ``shard_map`` over the param's
    spec, with the stacks split along dim 0 and the scalars replicated.
    """
    return run_all([BlockRun(self, fn, arrays, stacks, scalars)])[0][0]

  def run_alone(self, fn: Callable, arrays, stacks, scalars=()) -> tuple[list[jax.Array], Any]:
    """:meth:`run` of blocks that are not pooled with others' (:func:`run_all` calls it)."""

    def body(arrays, stacks, scalars, local):
      outs, new_stacks = fn([self.split(x, local) for x in arrays], stacks, *scalars)
      return [self.merge(o, local) for o in outs], new_stacks

    if self.mesh is None:
      return body(arrays, stacks, scalars, local=False)
    if self.dealt:
      return self._run_dealt(fn, arrays, stacks, scalars)
    if self.owners is not None:
      return self._run_owned(fn, arrays, stacks, scalars)
    param = P(*self.spec)
    mapped = jax.shard_map(
        functools.partial(body, local=True),
        mesh=self.mesh,
        in_specs=(param, self.stack_spec, P()),
        out_specs=(param, self.stack_spec),
        check_vma=False,
    )
    return mapped(list(arrays), stacks, list(scalars))

  def _run_dealt(self, fn: Callable, arrays, stacks, scalars):
    """:meth:`run` of a dealt param: each device the blocks of its piece, results gathered."""
    axes = stack_axes(self.spec)
    per_device = self.count // math.prod(self.shards)

    def body(arrays, stacks, scalars):
      start = jax.lax.axis_index(axes) * per_device
      mine = [jax.lax.dynamic_slice_in_dim(self.split(x), start, per_device) for x in arrays]
      return fn(mine, stacks, *scalars)

    mapped = jax.shard_map(
        body,
        mesh=self.mesh,
        in_specs=(P(), self.stack_spec, P()),
        out_specs=(self.stack_spec, self.stack_spec),
        check_vma=False,
    )
    outs, new_stacks = mapped(list(arrays), stacks, list(scalars))
    return [self.merge(o) for o in outs], new_stacks

  def _run_owned(self, fn: Callable, arrays, stacks, scalars):
    """:meth:`run` with :attr:`owners`: pieces of tiles to their owners and back."""
    dim, axis, holders = self.owners
    block_dim = 1 + dim - int(self.scanned)  # The dim in a (n, *sizes) stack.
    size = dict(self.mesh.shape)[axis]

    def to_owners(pieces):  # (n_local, *piece) -> (n_local / holders, *tile)
      chunks = pieces.reshape(holders, -1, *pieces.shape[1:])  # Chunk r: what r owns.
      got = jnp.moveaxis(_exchange(chunks, axis, holders, size), 0, block_dim)
      return got.reshape(*got.shape[:block_dim], -1, *got.shape[block_dim + 2 :])

    def from_owners(tiles):
      rows = tiles.shape[block_dim] // holders
      parts = tiles.reshape(*tiles.shape[:block_dim], holders, rows, *tiles.shape[block_dim + 1 :])
      back = _exchange(jnp.moveaxis(parts, block_dim, 0), axis, holders, size)
      return back.reshape(-1, *back.shape[2:])

    def body(arrays, stacks, scalars):
      tiles = [to_owners(self.split(x, local=True)) for x in arrays]
      outs, new_stacks = fn(tiles, stacks, *scalars)
      return [self.merge(from_owners(o), local=True) for o in outs], new_stacks

    param = P(*self.spec)
    mapped = jax.shard_map(
        body,
        mesh=self.mesh,
        in_specs=(param, self.stack_spec, P()),
        out_specs=(param, self.stack_spec),
        check_vma=False,
    )
    return mapped(list(arrays), stacks, list(scalars))

  def _owner_order(self, stack: jax.Array, inverse: bool = False) -> jax.Array:
    """A :attr:`whole_tiles` stack in owner order (device by device), or back.

    Whole-tile order is ``(*grid, holder, owned)``: each group's tiles, its holders' shares
    in turn; owner order puts the holder right after its dim's group, as devices are.
    """
    dim, _, holders = self.owners
    grid, tail = self.whole_tiles.shards, stack.shape[1:]
    ndim = len(grid)
    order = [*range(dim + 1), ndim, *range(dim + 1, ndim), ndim + 1]
    if inverse:
      shape, order = (*grid[: dim + 1], holders, *grid[dim + 1 :]), np.argsort(order).tolist()
    else:
      shape = (*grid, holders)
    split = stack.reshape(*shape, -1, *tail)
    return split.transpose(*order, *range(ndim + 2, split.ndim)).reshape(stack.shape)

  def _grid(self, x: jax.Array, local: bool) -> tuple[int, ...]:
    if local:
      return (1,) * x.ndim
    return self.shards


def _exchange(chunks: jax.Array, axis: str, holders: int, size: int) -> jax.Array:
  """In ``shard_map``: ``out[p]`` is the chunk that holder ``p`` of this device's group
  (``holders`` consecutive indices of ``axis``) sent it, having sent ``chunks[r]`` to
  holder ``r``: an all-to-all among each group (the whole axis: one all-to-all)."""
  if holders == size:
    return jax.lax.all_to_all(chunks, axis, 0, 0)
  me = jax.lax.axis_index(axis) % holders
  out = jax.lax.dynamic_update_index_in_dim(
      jnp.zeros_like(chunks), jax.lax.dynamic_index_in_dim(chunks, me, 0), me, 0
  )
  groups = range(0, size, holders)
  for shift in range(1, holders):
    send = jax.lax.dynamic_index_in_dim(chunks, (me + shift) % holders, 0, keepdims=False)
    pairs = [(g + p, g + (p + shift) % holders) for g in groups for p in range(holders)]
    got = jax.lax.ppermute(send, axis, pairs)
    out = jax.lax.dynamic_update_index_in_dim(out, got, (me - shift) % holders, 0)
  return out


class BlockRun(NamedTuple):
  """One :meth:`ShardBlocks.run` call: ``blocks.run(fn, arrays, stacks, scalars)``."""

  blocks: ShardBlocks
  fn: Callable
  arrays: Sequence[jax.Array]
  stacks: Any
  scalars: Sequence[jax.Array] = ()


class Pool(NamedTuple):
  """Pooled runs whose stacks are stored as one: ``members`` (indices of the runs), each
  member's tile count, and ``length``, the stored stacks' dim 0 (their total, padded to a
  multiple of the device count with copies of the last tile's)."""

  members: tuple[int, ...]
  counts: tuple[int, ...]
  length: int


# A pool is stored as one when padding it to the device count adds at most this share of it
# (the state then stays within 5% of the ideal).
STORED_POOL_PADDING = 0.05


def stored_pools(
    blocks: Sequence[ShardBlocks | None], stacks: Sequence, max_padding: float = STORED_POOL_PADDING
) -> tuple[Pool, ...]:
  """The :class:`Pool`s whose stacks an optimizer stores as one, in its pool layout.

  ``blocks[i]``/``stacks[i]``: run ``i``'s blocks (None: not blocked) and stacks (arrays or
  ``ShapeDtypeStruct``s, as its init makes them). Pooled blocks
  (:attr:`ShardBlocks.pooled`) of one tile shape and one stacks structure (shapes past dim 0,
  dtypes) form a pool; it is stored as one stack split over every mesh axis on dim 0 (each
  device the factors of the tiles it fits, so nothing moves for them in a step) when padding
  its tile count to a multiple of the device count adds at most ``max_padding`` of it (the
  optimizers' ``pool_padding``: memory for bytes); other pools keep each member's stacks, at
  the ideal, and move them to the pool each step.
  Depends on the mesh's device count only: the same on a ``Mesh`` and an ``AbstractMesh``.

  Example:
      >>> mesh = jax.sharding.AbstractMesh((4,), ("data",))
      >>> b = shard_blocks((8, 8), P("data"), mesh, 8)  # one 8-tile over 2-row shards
      >>> q = jax.ShapeDtypeStruct((1, 8, 8), jnp.float32)
      >>> stored_pools([b] * 39 + [None], [q] * 40)  # 39 tiles: padded to 40
      (Pool(members=(0, 1, ..., 38), counts=(1, 1, ..., 1), length=40),)
      >>> stored_pools([b] * 2, [q] * 2)  # 2 tiles padded to 4: kept per param
      ()
  """
  groups: dict[tuple, list[int]] = {}
  for i, (b, stack) in enumerate(zip(blocks, stacks, strict=True)):
    if b is not None and b.pooled:
      groups.setdefault(_stacks_key(b, stack), []).append(i)
  pools = []
  for members in groups.values():
    counts = tuple(blocks[i].count for i in members)
    devices = blocks[members[0]].devices
    padding = -sum(counts) % devices
    if padding <= max_padding * sum(counts):
      pools.append(Pool(tuple(members), counts, sum(counts) + padding))
  return tuple(pools)


def _stacks_key(blocks: ShardBlocks, stacks) -> tuple:
  """What a pool's members share: tile shape, devices, stacks' structure and shapes past
  dim 0 (a pool of mixed dtypes joins in the widest)."""
  leaves = jax.tree.leaves(stacks)
  return (
      blocks.sizes,
      blocks.devices,
      jax.tree.structure(stacks),
      tuple(tuple(x.shape[1:]) for x in leaves),
  )


def pack(stacks: Sequence, pools: Sequence[Pool]) -> tuple[list, tuple]:
  """``(stacks, pooled)``: each member's stacks replaced by its placeholder (its structure,
  None for every array) and each pool's stacks joined, padded to its ``length``.

  Example:
      >>> pool = Pool((0, 1), (1, 2), 4)
      >>> kept, (joined,) = pack([jnp.zeros((1, 2)), jnp.ones((2, 2)), jnp.ones(3)], [pool])
      >>> kept[0], joined[:, 0].tolist(), kept[2].shape
      (None, [0.0, 1.0, 1.0, 1.0], (3,))
  """
  kept, pooled = list(stacks), []
  for pool in pools:
    parts = [stacks[i] for i in pool.members]
    join = functools.partial(
        lambda *xs, length: padded(jnp.concatenate(xs), length), length=pool.length
    )
    pooled.append(jax.tree.map(join, *parts))
    for i in pool.members:
      kept[i] = _placeholder(stacks[i])
  return kept, tuple(pooled)


def _placeholder(stacks) -> Any:
  """``stacks``' structure with None for every array: a stored pool member's own stacks."""
  return jax.tree.map(lambda _: None, stacks)


def padded(stack: jax.Array, length: int) -> jax.Array:
  """``stack`` padded to ``length`` along dim 0 with copies of its last block.

  Example:
      >>> padded(jnp.arange(2.0), 4).tolist()
      [0.0, 1.0, 1.0, 1.0]
  """
  return jnp.concatenate([stack, jnp.repeat(stack[-1:], length - stack.shape[0], axis=0)])


def run_all(
    runs: Sequence[BlockRun | None], pools: Sequence[tuple[Pool, Any]] = ()
) -> tuple[list[tuple[list[jax.Array], Any] | None], tuple]:
  """``(results, pooled)``: each run's ``(outs, new_stacks)``, and each stored pool's new stacks.

  ``runs[i]`` None: nothing to run (its result is None). ``pools``: ``(Pool, its stored
  stacks)`` per pool of :func:`stored_pools` over the same indices (their members' own
  stacks are placeholders, and come back as they went). Other runs whose blocks are
  :attr:`ShardBlocks.pooled` and that share ``fn`` (the same object), the tile shape and the
  stacks' structure, shapes and dtypes form one pool on a concrete mesh: their block stacks
  (arrays and stacks) are concatenated, padded to a multiple of the device count and split
  over every mesh axis, and ``fn`` runs once on the pool. A scalar every run of a pool passes
  as the same object stays a scalar; other scalars reach ``fn`` as one value per block
  (``(n,)``). Other runs are :meth:`ShardBlocks.run` calls.

  Example:
      >>> double = lambda arrays, stacks: ([2 * arrays[0]], stacks)
      >>> blocks = shard_blocks((4, 4), (), None, 2)
      >>> [((out,), _)], _ = run_all([BlockRun(blocks, double, [jnp.ones((4, 4))], ())])
      >>> float(out.sum())
      32.0
  """
  results: list = [None] * len(runs)
  stored = {i for pool, _ in pools for i in pool.members}
  _record(runs, pools)
  groups: dict[tuple, list[int]] = {}
  for i, run in enumerate(runs):
    if run is None or i in stored:
      continue
    if run.blocks.in_pool:
      groups.setdefault(_pool_key(run), []).append(i)
    else:
      results[i] = run.blocks.run_alone(run.fn, run.arrays, run.stacks, run.scalars)
  for members in groups.values():
    outs, new_stacks = _run_pool([runs[i] for i in members])
    for i, out, new in zip(members, outs, new_stacks):
      results[i] = (out, new)
  pooled = []
  for pool, stacks in pools:
    members = [runs[i] for i in pool.members]
    _check_stored(members, pool, stacks)
    outs, (new_stacks,) = _run_pool(members, (pool, stacks))
    for i, out in zip(pool.members, outs):
      results[i] = (out, runs[i].stacks)
    pooled.append(new_stacks)
  return results, tuple(pooled)


def _check_stored(runs: Sequence[BlockRun], pool: Pool, stacks) -> None:
  if len({id(run.fn) for run in runs}) > 1 or any(
      x.shape[0] != pool.length for x in jax.tree.leaves(stacks)
  ):
    raise OptimizerError(
        f"a stored pool of {len(runs)} runs needs one fn and stacks of {pool.length} blocks; "
        "build its stacks with layout.stored_pools and layout.pack"
    )


def _pool_key(run: BlockRun) -> tuple:
  dtypes = tuple(x.dtype for x in [*run.arrays, *jax.tree.leaves(run.stacks)])
  return (run.fn, run.blocks.mesh, dtypes) + _stacks_key(run.blocks, run.stacks)


def _run_pool(runs: Sequence[BlockRun], stored: tuple[Pool, Any] | None = None):
  """``(outs per run, new stacks)``: ``fn`` once on the runs' blocks, in ``shard_map`` over
  the pool's dim 0 split over every mesh axis (each device its ``1/N`` of the tiles); on an
  ``AbstractMesh`` on global arrays. ``stored``: the pool's stored stacks (new stacks: one,
  the pool's), else each run's own (new stacks: per run, its rows of the pool's).

  Each run's arrays are cut into tiles on their :func:`_tile_spec` and the tiles held
  split over the mesh axes along a tile dim (as unstored stacks are, :func:`stack_specs`),
  so that joining them is local and the pool's move to dim 0 (and back) is one all-to-all
  per array. Each stack is split along a block dim of its own: a 3-D or 4-D param's tile
  stack ``(n, *sizes)`` and its factor stacks (``(n, b, b)``, ``(n, b)``) differ in rank.
  """
  mesh = runs[0].blocks.mesh
  sizes = {} if mesh is None else dict(mesh.shape)
  axes = stack_axes((), sizes)
  dealt = P(_entry(axes))
  place = (
      lambda x, spec: x
      if mesh is None
      else jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
  )
  # A stack (tiles or factors, of any rank) split along a block dim, never its dim 0.
  along = lambda x: place(x, P(None, *_spread(x.shape[1:], axes, sizes)))
  counts = [run.blocks.count for run in runs]
  devices = 1 if mesh is None else mesh.size
  total = stored[0].length if stored else sum(counts) + -sum(counts) % devices

  def pool(parts):  # Padded with copies of the last block: finite, and dropped after.
    stack = jnp.concatenate([along(x) for x in parts])
    return place(along(padded(stack, total)), dealt)

  tile_specs = [None if mesh is None else _tile_spec(run.blocks, sizes) for run in runs]
  at = lambda x, spec: x if spec is None else place(x, spec)
  # Each array resharded to its run's tile layout, then cut into its tiles.
  tiles = [[r.blocks.split(at(x, t)) for x in r.arrays] for r, t in zip(runs, tile_specs)]
  arrays = [pool(parts) for parts in zip(*tiles)]
  if stored:
    stacks = jax.tree.map(lambda x: place(x, dealt), stored[1])
  else:
    stacks = jax.tree.map(lambda *parts: pool(parts), *[r.stacks for r in runs])
  shared, per_block = [], []
  for values in zip(*[r.scalars for r in runs]):
    same = all(v is values[0] for v in values)
    shared.append(values[0] if same else None)
    per_block.append(
        None
        if same
        else jnp.concatenate([jnp.broadcast_to(v, (n,)) for v, n in zip(values, counts)])
    )

  def body(arrays, stacks, per_block):
    start = 0 if mesh is None else jax.lax.axis_index(axes) * (total // devices)
    mine = lambda v: jax.lax.dynamic_slice_in_dim(
        jnp.pad(v, (0, total - v.shape[0])), start, total // devices
    )
    scalars = [s if v is None else mine(v) for s, v in zip(shared, per_block)]
    return runs[0].fn(arrays, stacks, *scalars)

  if mesh is not None:
    body = jax.shard_map(
        body, mesh=mesh, in_specs=(dealt, dealt, P()), out_specs=(dealt, dealt), check_vma=False
    )
  outs, new_stacks = body(arrays, stacks, per_block)
  outs = [along(o) for o in outs]
  if stored:
    new_stacks = [jax.tree.map(lambda x: place(x, dealt), new_stacks)]
  else:
    new_stacks = jax.tree.map(along, new_stacks)
  merged, cuts, start = [], [], 0
  for run, n, tile_spec in zip(runs, counts, tile_specs):
    cut = lambda x, start=start, n=n: x[start : start + n]
    spec = P(*run.blocks.spec)
    merged.append([at(at(run.blocks.merge(cut(o)), tile_spec), spec) for o in outs])
    if not stored:
      cuts.append(jax.tree.map(cut, new_stacks))
    start += n
  return merged, new_stacks if stored else cuts


def _tile_spec(blocks: ShardBlocks, sizes: dict[str, int]) -> P:
  """Where a pooled param is cut into tiles: all its mesh axes (in mesh order) on the
  first dim whose shards they keep in step with the tiles (each shard whole tiles, or
  whole pieces of one tile); without such a dim, its spec with each axis out of step
  moved to a dim it keeps in step, else dropped (gathered over).

  Cutting the param into tiles is then a reshape XLA partitions as it is, and the tiles
  reach the pool (split over the mesh axes on dim 0) in one all-to-all; a moved axis costs
  another (each of about a shard's bytes).

  Example:
      >>> mesh = jax.sharding.AbstractMesh((4, 2), ("data", "model"))
      >>> blocks = ShardBlocks((768, 256), (1, 1), 256, spec=("model", "data"), pooled=True)
      >>> _tile_spec(blocks, dict(mesh.shape))  # 384-row shards: all on the columns
      P(None, ('data', 'model'))
  """
  dims = range(int(blocks.scanned), len(blocks.shape))
  entries = [list(stack_axes((e,))) for e in blocks.spec]
  own = {a for d in dims for a in entries[d]}
  ordered = [a for a in sizes if a in own]
  in_step = lambda d, axes: _in_step(
      blocks.shape[d], math.prod(sizes[a] for a in axes), blocks.block_size
  )
  together = next((d for d in dims if in_step(d, ordered)), None)
  if together is not None:
    return P(
        *(
            _entry(ordered if d == together else entries[d] if d not in dims else [])
            for d in range(len(entries))
        )
    )
  moved = [a for d in dims for a in entries[d] if not in_step(d, entries[d])]
  for d in dims:
    entries[d] = [a for a in entries[d] if a not in moved]
  for axis in moved:
    d = next((d for d in dims if in_step(d, [*entries[d], axis])), None)
    if d is not None:
      entries[d].append(axis)
  return P(*(_entry(e) for e in entries))


def _entry(axes: Sequence[str]):
  """A spec entry naming ``axes``: None, one axis, or a tuple of them."""
  return tuple(axes) if len(axes) > 1 else (axes[0] if axes else None)


def _in_step(extent: int, shards: int, block_size: int) -> bool:
  """Whether ``shards`` even shards of a dim of ``extent`` hold whole tiles or whole
  pieces of one tile each."""
  if extent % shards:
    return False
  local = extent // shards
  return local % block_size == 0 or (
      block_size % local == 0 and extent % min(block_size, extent) == 0
  )


def _record(runs: Sequence[BlockRun | None], pools: Sequence[tuple[Pool, Any]]) -> None:
  """Tells :func:`stack_runs` (while it traces) where each run's stacks are: its own, or its
  rows of a stored pool's."""
  records = _RUNS.get()
  if records is None:
    return
  rows = {}
  for pool, stacks in pools:
    offsets = np.cumsum((0,) + pool.counts[:-1])
    rows.update({i: (stacks, int(o)) for i, o in zip(pool.members, offsets)})
  for i, run in enumerate(runs):
    if run is not None:
      records.append((run.blocks, *rows.get(i, (run.stacks, None))))


def same_blocking(a: ShardBlocks, b: ShardBlocks) -> bool:
  """Whether two layouts of one param cut it into the same blocks (so the same math).

  Their factors then hold the same values, stacked in another order; otherwise
  factors fitted under one layout cannot precondition the other's blocks.

  Example:
      >>> on = lambda n, blocking="tiles": shard_blocks((512, 256), P("data"),
      ...     jax.sharding.AbstractMesh((n,), ("data",)), 128, blocking=blocking)
      >>> same_blocking(on(2), on(8)), same_blocking(on(2, "local"), on(8, "local"))  # 64 rows
      (True, False)
  """
  return a.shape == b.shape and a.scanned == b.scanned and a.tiles() == b.tiles()


def reorder(stack: jax.Array, old: ShardBlocks, new: ShardBlocks) -> jax.Array:
  """A block stack of layout ``old`` in the order of layout ``new`` (same blocking).

  Example:
      >>> mesh = lambda n: jax.sharding.AbstractMesh((n,), ("data",))
      >>> a = shard_blocks((4, 4), P(None, "data"), mesh(2), 2)
      >>> b = shard_blocks((4, 4), P(None, "data"), mesh(1), 2)
      >>> x = jnp.arange(16.0).reshape(4, 4)
      >>> bool((reorder(a.split(x), a, b) == b.split(x)).all())
      True
  """
  if not same_blocking(old, new):
    raise OptimizerError(f"blocks of {old.shape} differ between the layouts; re-initialise them")
  ids = jnp.arange(math.prod(old.shape), dtype=jnp.int32).reshape(old.shape)
  corner = lambda blocks: blocks.split(ids).reshape(blocks.count, -1)[:, 0]
  old_ids, first = corner(old), corner(new)
  where = jnp.argsort(old_ids)[jnp.searchsorted(jnp.sort(old_ids), first)]
  return stack[where]


class StackedRun(NamedTuple):
  """Where one :class:`BlockRun`'s stacks are in an optimizer state: ``leaves`` (indices of
  the flattened state), its own (``offset`` None) or a stored pool's, whose rows
  ``offset`` to ``offset + blocks.count`` are its blocks'."""

  blocks: ShardBlocks
  leaves: tuple[int, ...]
  offset: int | None


def stack_runs(tx, params, state) -> list[StackedRun]:
  """Each :class:`BlockRun` of ``tx.update`` (in the order its update makes them) as a
  :class:`StackedRun` of ``state``.

  Traces ``tx.update`` on ``params``-shaped grads (nothing runs). Two layouts of one
  optimizer give the same runs, one per blocked param, in the same order.

  Example:
      >>> from bv_sharding.optimizers.shampoo import scale_by_shampoo
      >>> params = {"w": jax.ShapeDtypeStruct((8, 4), jnp.float32)}
      >>> tx = scale_by_shampoo(block_size=4, graft_type="sgd", beta1=0.0)
      >>> [(r.blocks.count, r.leaves, r.offset) for r in stack_runs(tx, params,
      ...     jax.eval_shape(tx.init, params))]
      [(2, (1, 2, 3, 4), None)]
  """
  leaves, treedef = jax.tree.flatten(state)
  # Traced in float32, a state stored narrower (state_dtype.py) reaches run_all uncast, as
  # the very leaves passed in.
  leaves = [jax.ShapeDtypeStruct(x.shape, compute_dtype(x.dtype)) for x in leaves]
  # Shapes alone (no shardings): what is traced is which leaves are stacks, on any mesh.
  params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
  found = []

  def update(grads, leaves):
    records = []
    token = _RUNS.set(records)
    try:
      tx.update(grads, treedef.unflatten(leaves), grads)
    finally:
      _RUNS.reset(token)
    index = {id(x): i for i, x in enumerate(leaves)}
    for blocks, stacks, offset in records:
      ids = [index.get(id(x)) for x in jax.tree.leaves(stacks)]
      found.append(StackedRun(blocks, tuple(i for i in ids if i is not None), offset))

  jax.eval_shape(update, params, leaves)
  return found


def stack_blocks(tx, params, state) -> list[ShardBlocks | None]:
  """Per leaf of ``state`` (flattened), the blocks it stacks along dim 0, else None (a stored
  pool's leaves: its first member's blocks).

  Example:
      >>> from bv_sharding.optimizers.shampoo import scale_by_shampoo
      >>> params = {"w": jax.ShapeDtypeStruct((8, 4), jnp.float32)}
      >>> tx = scale_by_shampoo(block_size=4, graft_type="sgd", beta1=0.0)
      >>> [b and b.count for b in stack_blocks(tx, params, jax.eval_shape(tx.init, params))]
      [None, 2, 2, 2, 2]
  """
  found = [None] * len(jax.tree.leaves(state))
  for run in stack_runs(tx, params, state):
    for i in run.leaves:
      found[i] = found[i] or run.blocks
  return found


def stack_specs(tx, params, state, mesh_sizes: dict[str, int]) -> list[P | None]:
  """Per leaf of ``state`` (flattened): the spec to store its block stack in, else None.

  All the param's axes (``mesh_sizes``: the mesh's axis sizes), on dim 0 while they divide
  it: each device the stack slice of its own tiles. A stack of pooled tiles
  (:attr:`ShardBlocks.pooled`: dealt over the whole mesh) takes every mesh axis: a pool
  stored as one on dim 0 (its length is a multiple of the device count), where each
  device's slice is fitted; a member's own stack puts those dim 0 cannot take on the tiles'
  rows, then columns: stored at the ideal, moved to the tiles' owners for the step.

  Example:
      >>> from bv_sharding.optimizers.kron import scale_by_kron
      >>> mesh = jax.sharding.AbstractMesh((4,), ("data",))
      >>> params = {"w": jax.ShapeDtypeStruct((8, 4), jnp.float32)}
      >>> tx = scale_by_kron(block_size=4, layout=ParamLayout({"w": P("data")}, mesh))
      >>> stack_specs(tx, params, jax.eval_shape(tx.init, params), {"data": 4})[:2]  # the Qs
      [P(None, 'data', None), P(None, 'data', None)]
  """
  leaves = jax.tree.leaves(state)
  specs = []
  for blocks, x in zip(stack_blocks(tx, params, state), leaves, strict=True):
    axes = () if blocks is None else _stored_axes(blocks, mesh_sizes)
    specs.append(None if blocks is None else P(*_spread(x.shape, axes, mesh_sizes)))
  return specs


def _stored_axes(blocks: ShardBlocks, sizes: dict[str, int]) -> tuple[str, ...]:
  """The mesh axes a stack of ``blocks`` is stored over: every axis for a pool, else its
  param's (none for a replicated param computed whole)."""
  return stack_axes((), sizes) if blocks.pooled else stack_axes(blocks.spec)


def _spread(shape, axes, sizes: dict[str, int]) -> tuple:
  """``axes`` together on the first dim of ``shape`` they divide (one all-to-all from the
  pool's dim 0), else each on the first dim it divides (with those already there)."""
  together = next(
      (d for d, n in enumerate(shape) if n % math.prod(sizes[a] for a in axes) == 0), None
  )
  if together is not None:
    return tuple(_entry(axes if d == together else ()) for d in range(len(shape)))
  placed = [[] for _ in shape]
  for axis in axes:
    for dim, extent in enumerate(shape):
      if extent % (math.prod(sizes[a] for a in placed[dim]) * sizes[axis]) == 0:
        placed[dim].append(axis)
        break
  return tuple(_entry(p) for p in placed)


def spread_sharding(shape, mesh) -> NamedSharding:
  """A block stack of ``shape`` spread over every axis of ``mesh`` as :func:`stack_specs`
  stores stacks (on dim 0 where the device count divides it, else on other dims).

  Example:
      >>> mesh = jax.sharding.AbstractMesh((4,), ("data",))
      >>> spread_sharding((8, 4, 4), mesh).spec, spread_sharding((2, 4, 4), mesh).spec
      (P('data', None, None), P(None, 'data', None))
  """
  sizes = dict(mesh.shape)
  return NamedSharding(mesh, P(*_spread(shape, stack_axes((), sizes), sizes)))


def tiles_text(blocks: ShardBlocks | None) -> str:
  """A one-line description of a stack's blocks, for errors."""
  if blocks is None:
    return "no blocks"
  return f"{blocks.sizes} blocks of a {blocks.shape} param in {blocks.shards} shards"
