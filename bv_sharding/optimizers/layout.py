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
* a param's block stacks are stored with its block grid as leading dims
  (:attr:`ShardBlocks.grid_shape`: a 2-D param's factor stack is ``(g_0, g_1, b, b)``, a scanned
  param's layers first), each block at its place in the param: the state is the same on
  any mesh. Shard-local blocks store them on the param's own spec
  (:meth:`ShardBlocks.stored_spec`), so each device holds the factors of its own shard's
  blocks and a reshape inside ``shard_map`` gives its run order (shard-major, each shard's
  blocks as :func:`~bv_sharding.optimizers.tensor_ops.blockify` orders them);
* on a concrete ``Mesh`` the per-block work runs in ``jax.shard_map`` over the param's
  spec: no collective but the scalars computed outside it (norms, counters). On an
  ``AbstractMesh`` (or without a layout) the same blocks are computed on global
  arrays: the unsharded reference, and shapes for planning.

Same math on any mesh (``blocking="tiles"``, the default): the blocks are the param's own
grid of ``block_size`` tiles whatever the device count; where a tile spans several shards
its holders exchange what it needs (:attr:`ShardBlocks.owners`) or it is pooled with other
params' tiles and dealt over the mesh (:attr:`ShardBlocks.pooled`, :func:`run_all`); the
stacks of such tiles are stored spread at the ideal and moved to where they are fitted each
step. So a state saved on one mesh is the state of any other: put onto it with the new
plan's shardings (:mod:`bv_sharding.optimizers.placement` declares them to ``bvs.plan``),
each factor still preconditions its own tile.
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
from bv_sharding.optimizers.tensor_ops import blockify, unblockify

# A never-sharded param's block stack of at least this many elements is stored spread over
# the mesh (:meth:`ShardBlocks.stored_spec`): 4 MiB in float32, big_vision's fsdp threshold.
# Counted in elements, not bytes, so the plan and the optimizer agree whatever the state dtype.
SPREAD_MIN_ELEMENTS = 2**20

BLOCKINGS = ("tiles", "local")  # The param's fixed tile grid (default), or each shard's own blocks.


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
  stacks of owned and pooled tiles are stored spread at the ideal
  (:meth:`stored_spec`) and move the same way as the arrays.
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
    """Spec of dim 0 of a block stack in run order: split over the param's axes (shard-major)."""
    axes = stack_axes(self.spec)
    return P(_entry(axes)) if axes else P()

  @property
  def grid_shape(self) -> tuple[int, ...]:
    """Blocks along each dim of the param (a scanned param's layers first): the leading dims
    of a block stack as stored, each dim's blocks in the order of their place in the param.

    Under ``blocking="tiles"`` the param's tile grid, the same on any mesh.

    Example:
        >>> ShardBlocks((8, 6), (2, 1), block_size=2).grid_shape
        (4, 3)
    """
    if self.owners is not None:
      return self.whole_tiles.grid_shape
    return tuple(s * c for s, c in zip(self.shards, self._per_shard))

  @property
  def _per_shard(self) -> tuple[int, ...]:
    """Blocks (a scanned param's layers on dim 0) along each dim of one shard."""
    local = self.local_shape
    per_layer = local[1:] if self.scanned else local
    counts = tuple(-(-e // b) for e, b in zip(per_layer, self.sizes))
    return (local[0], *counts) if self.scanned else counts

  def to_run(self, stack: jax.Array) -> jax.Array:
    """A stored block stack ``(*grid, ...)`` in run order ``(count, ...)``: shard-major, then
    each shard's blocks as :meth:`split` cuts them (with :attr:`owners`, owner order)."""
    if self.owners is not None:
      return self._owner_order(self.whole_tiles.to_run(stack))
    n, per = len(self.shards), self._per_shard
    split = stack.reshape(*[v for s, c in zip(self.shards, per) for v in (s, c)], *stack.shape[n:])
    order = [*range(0, 2 * n, 2), *range(1, 2 * n, 2), *range(2 * n, split.ndim)]
    return split.transpose(order).reshape(-1, *stack.shape[n:])

  def from_run(self, stack: jax.Array) -> jax.Array:
    """Inverse of :meth:`to_run`.

    Example:
        >>> blocks = ShardBlocks((8, 6), (2, 1), block_size=2)
        >>> x = jnp.arange(48.0).reshape(8, 6)
        >>> stored = blocks.from_run(blocks.split(x))  # each block's place in the param
        >>> stored.shape, bool((stored[1, 2] == x[2:4, 4:6]).all())
        ((4, 3, 2, 2), True)
    """
    if self.owners is not None:
      return self.whole_tiles.from_run(self._owner_order(stack, inverse=True))
    n, per = len(self.shards), self._per_shard
    split = stack.reshape(*self.shards, *per, *stack.shape[1:])
    order = [*(v for k in range(n) for v in (k, n + k)), *range(2 * n, split.ndim)]
    return split.transpose(order).reshape(*self.grid_shape, *stack.shape[1:])

  @property
  def shard_local(self) -> bool:
    """Whether each device holds the blocks of its own shard (or dealt piece): a stored stack
    takes the param's spec on its grid dims and reaches :meth:`run` as it is stored."""
    return self.owners is None and not self.pooled

  def stored_spec(self, shape, sizes: dict[str, int]) -> P:
    """Where a block stack of ``shape`` (``(*grid, ...)``) is stored on a mesh of ``sizes``.

    Shard-local blocks (:attr:`shard_local`): the param's spec (or its dealt piece's) on the
    grid dims, so each device stores the factors of its own blocks. A never-sharded param's
    blocks are computed whole on every device; a stack of theirs that reaches
    :data:`SPREAD_MIN_ELEMENTS` is stored spread over every mesh axis, at the ideal, and
    gathered for the step (no big state stranded beside a param big_vision's ``fsdp`` leaves
    whole), smaller ones stay whole like their param (a ``replicate()`` strategy keeps small
    models' state replicated, as data parallelism does). Tiles dealt to owners
    (:attr:`owners`) or pooled over the mesh (:attr:`pooled`): the grid whole, the param's axes
    (a pool's: every mesh axis) spread over the blocks' own dims, at the ideal; each step an
    all-to-all moves them to where they are fitted, and back.

    Example:
        >>> mesh = jax.sharding.AbstractMesh((4,), ("data",))
        >>> local = shard_blocks((8, 6), P("data"), mesh, 2)
        >>> local.stored_spec((4, 3, 2, 2), {"data": 4})
        P('data', None, None, None)
        >>> owned = shard_blocks((8, 6), P("data"), mesh, 4)  # 4-row tiles over 2-row shards
        >>> owned.owners, owned.stored_spec((2, 2, 4, 4), {"data": 4})
        ((0, 'data', 2), P(None, None, 'data', None))
    """
    grid = len(self.grid_shape)
    if self.shard_local and not stack_axes(self.spec):  # A never-sharded param's.
      big = math.prod(shape) >= SPREAD_MIN_ELEMENTS
      return P(*_spread(tuple(shape), stack_axes((), sizes) if big else (), sizes))
    if self.shard_local:
      return P(*self.spec, *(None,) * (len(shape) - grid))
    axes = stack_axes((), sizes) if self.pooled else stack_axes(self.spec)
    return P(*(None,) * grid, *_spread(tuple(shape)[grid:], axes, sizes))

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
    shards = self._shards_for(x, local)
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
      outs, new_stacks = body(arrays, _tree(self.to_run, stacks), scalars, local=False)
      return outs, _tree(self.from_run, new_stacks)
    if self.owners is not None:
      return self._run_owned(fn, arrays, stacks, scalars)
    fn = self._on_stored(fn)
    if self.dealt:
      return self._run_dealt(fn, arrays, stacks, scalars)
    param = P(*self.spec)  # A stored stack's grid dims too: each device its own blocks.
    mapped = jax.shard_map(
        functools.partial(body, local=True),
        mesh=self.mesh,
        in_specs=(param, param, P()),
        out_specs=(param, param),
        check_vma=False,
    )
    return mapped(list(arrays), stacks, list(scalars))

  def _on_stored(self, fn: Callable) -> Callable:
    """``fn`` of run-order stacks as a function of one device's stored stacks (in
    ``shard_map``): its blocks' factors, a reshape away from its run order."""
    per, n = self._per_shard, len(self.shards)

    def on_stored(arrays, stacks, *scalars):
      outs, new_stacks = fn(arrays, _tree(lambda x: x.reshape(-1, *x.shape[n:]), stacks), *scalars)
      return outs, _tree(lambda x: x.reshape(*per, *x.shape[1:]), new_stacks)

    return on_stored

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
        in_specs=(P(), P(*self.spec), P()),
        out_specs=(self.stack_spec, P(*self.spec)),
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

    sizes, axes, grid = dict(self.mesh.shape), stack_axes(self.spec), len(self.grid_shape)
    leaves, treedef = jax.tree.flatten(stacks)
    specs = [self.stored_spec(x.shape, sizes) for x in leaves]
    # The tail dim of each stored stack that holds all the param's axes: one all-to-all moves
    # it to its owners' run order (dim 0 over those axes), and back. Else XLA moves it.
    dims = [next((d for d, e in enumerate(s) if e == _entry(axes)), None) for s in specs]
    by_exchange = all(d is not None for d in dims)

    # In shard_map: a stored stack in run order, and back (each its own way: see above).
    there = lambda x, d: jax.lax.all_to_all(self.to_run(x), axes, 0, 1 + d - grid, tiled=True)
    back = lambda x, d: self.from_run(jax.lax.all_to_all(x, axes, 1 + d - grid, 0, tiled=True))
    if not by_exchange:
      there = back = lambda x, d: x
      specs, leaves = [self.stack_spec] * len(leaves), [self.to_run(x) for x in leaves]

    def body(arrays, leaves, scalars):
      tiles = [to_owners(self.split(x, local=True)) for x in arrays]
      stacks = treedef.unflatten([there(x, d) for x, d in zip(leaves, dims)])
      outs, new_stacks = fn(tiles, stacks, *scalars)
      new_leaves = [back(x, d) for x, d in zip(jax.tree.leaves(new_stacks), dims)]
      return [self.merge(from_owners(o), local=True) for o in outs], new_leaves

    param = P(*self.spec)
    mapped = jax.shard_map(
        body,
        mesh=self.mesh,
        in_specs=(param, specs, P()),
        out_specs=(param, specs),
        check_vma=False,
    )
    outs, new_leaves = mapped(list(arrays), leaves, list(scalars))
    if not by_exchange:
      new_leaves = [self.from_run(x) for x in new_leaves]
    return outs, self.stored(treedef.unflatten(new_leaves))

  def stored(self, stacks):
    """``stacks`` (stored form) constrained to :meth:`stored_spec` on this run's mesh."""
    if self.mesh is None:
      return stacks
    sizes = dict(self.mesh.shape)
    place = lambda x: jax.lax.with_sharding_constraint(
        x, NamedSharding(self.mesh, self.stored_spec(x.shape, sizes))
    )
    return _tree(place, stacks)

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

  def _shards_for(self, x: jax.Array, local: bool) -> tuple[int, ...]:
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


def _tree(fn: Callable, stacks):
  """``fn`` on every array of a pytree of stacks (None kept)."""
  return jax.tree.map(fn, stacks)


class BlockRun(NamedTuple):
  """One :meth:`ShardBlocks.run` call: ``blocks.run(fn, arrays, stacks, scalars)``."""

  blocks: ShardBlocks
  fn: Callable
  arrays: Sequence[jax.Array]
  stacks: Any
  scalars: Sequence[jax.Array] = ()


def _stacks_key(blocks: ShardBlocks, stacks) -> tuple:
  """What a pool's members share: tile shape, devices, stacks' structure and each stack's
  shape past its grid (a pool of mixed dtypes joins in the widest)."""
  grid = len(blocks.grid_shape)
  return (
      blocks.sizes,
      blocks.devices,
      jax.tree.structure(stacks),
      tuple(tuple(x.shape[grid:]) for x in jax.tree.leaves(stacks)),
  )


def padded(stack: jax.Array, length: int) -> jax.Array:
  """``stack`` padded to ``length`` along dim 0 with copies of its last block.

  Example:
      >>> padded(jnp.arange(2.0), 4).tolist()
      [0.0, 1.0, 1.0, 1.0]
  """
  return jnp.concatenate([stack, jnp.repeat(stack[-1:], length - stack.shape[0], axis=0)])


def run_all(runs: Sequence[BlockRun | None]) -> list[tuple[list[jax.Array], Any] | None]:
  """Each run's ``(outs, new_stacks)`` (``runs[i]`` None: nothing to run, its result None).

  ``stacks`` go in and come back stored (``(*grid, ...)``, :meth:`ShardBlocks.stored_spec`).
  Runs whose blocks are :attr:`ShardBlocks.pooled` and that share ``fn`` (the same object),
  the tile shape and the stacks' structure, shapes and dtypes form one pool on a concrete
  mesh: their block stacks (arrays and stacks) are concatenated, padded to a multiple of the
  device count and split over every mesh axis, and ``fn`` runs once on the pool. A scalar
  every run of a pool passes as the same object stays a scalar; other scalars reach ``fn``
  as one value per block (``(n,)``). Other runs are :meth:`ShardBlocks.run` calls.

  Example:
      >>> double = lambda arrays, stacks: ([2 * arrays[0]], stacks)
      >>> blocks = shard_blocks((4, 4), (), None, 2)
      >>> [((out,), _)] = run_all([BlockRun(blocks, double, [jnp.ones((4, 4))], ())])
      >>> float(out.sum())
      32.0
  """
  results: list = [None] * len(runs)
  groups: dict[tuple, list[int]] = {}
  for i, run in enumerate(runs):
    if run is None:
      continue
    if run.blocks.in_pool:
      groups.setdefault(_pool_key(run), []).append(i)
    else:
      results[i] = run.blocks.run_alone(run.fn, run.arrays, run.stacks, run.scalars)
  for members in groups.values():
    outs, new_stacks = _run_pool([runs[i] for i in members])
    for i, out, new in zip(members, outs, new_stacks):
      results[i] = (out, new)
  return results


def _pool_key(run: BlockRun) -> tuple:
  dtypes = tuple(x.dtype for x in [*run.arrays, *jax.tree.leaves(run.stacks)])
  return (run.fn, run.blocks.mesh, dtypes) + _stacks_key(run.blocks, run.stacks)


def _run_pool(runs: Sequence[BlockRun]):
  """``(outs per run, new stacks per run)``: ``fn`` once on the runs' blocks, in ``shard_map``
  over the pool's dim 0 split over every mesh axis (each device its ``1/N`` of the tiles).

  Each run's arrays are cut into tiles on their :func:`_tile_spec` and the tiles held
  split over the mesh axes along a tile dim, and so are its stacks (stored spread,
  :meth:`ShardBlocks.stored_spec`), so that joining them is local and the pool's move to
  dim 0 (and back) is one all-to-all per array. Each stack is split along a block dim of its
  own: a 3-D or 4-D param's tile stack ``(n, *sizes)`` and its factor stacks (``(n, b, b)``,
  ``(n, b)``) differ in rank.
  """
  mesh = runs[0].blocks.mesh
  sizes = dict(mesh.shape)
  axes = stack_axes((), sizes)
  dealt = P(_entry(axes))
  place = lambda x, spec: jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
  # A stack (tiles or factors, of any rank) split along a block dim, never its dim 0.
  along = lambda x: place(x, P(None, *_spread(x.shape[1:], axes, sizes)))
  counts = [run.blocks.count for run in runs]
  total = sum(counts) + -sum(counts) % mesh.size

  def pool(parts):  # Padded with copies of the last block: finite, and dropped after.
    stack = jnp.concatenate([along(x) for x in parts])
    return place(along(padded(stack, total)), dealt)

  tile_specs = [_tile_spec(run.blocks, sizes) for run in runs]
  # Each array resharded to its run's tile layout, then cut into its tiles.
  tiles = [[r.blocks.split(place(x, t)) for x in r.arrays] for r, t in zip(runs, tile_specs)]
  arrays = [pool(parts) for parts in zip(*tiles)]
  flat = [_tree(r.blocks.to_run, r.stacks) for r in runs]
  stacks = jax.tree.map(lambda *parts: pool(parts), *flat)
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
    start = jax.lax.axis_index(axes) * (total // mesh.size)
    mine = lambda v: jax.lax.dynamic_slice_in_dim(
        jnp.pad(v, (0, total - v.shape[0])), start, total // mesh.size
    )
    scalars = [s if v is None else mine(v) for s, v in zip(shared, per_block)]
    return runs[0].fn(arrays, stacks, *scalars)

  body = jax.shard_map(
      body, mesh=mesh, in_specs=(dealt, dealt, P()), out_specs=(dealt, dealt), check_vma=False
  )
  outs, new_stacks = body(arrays, stacks, per_block)
  outs = [along(o) for o in outs]
  new_stacks = jax.tree.map(along, new_stacks)
  merged, cuts, start = [], [], 0
  for run, n, tile_spec in zip(runs, counts, tile_specs):
    cut = lambda x, start=start, n=n, blocks=run.blocks: blocks.from_run(x[start : start + n])
    spec = P(*run.blocks.spec)
    merged.append(
        [place(place(run.blocks.merge(x[start : start + n]), tile_spec), spec) for x in outs]
    )
    cuts.append(run.blocks.stored(_tree(cut, new_stacks)))
    start += n
  return merged, cuts


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


def tiles_text(blocks: ShardBlocks | None) -> str:
  """A one-line description of a stack's blocks, for errors."""
  if blocks is None:
    return "no blocks"
  return f"{blocks.sizes} blocks of a {blocks.shape} param in {blocks.shards} shards"
