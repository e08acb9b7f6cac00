"""Tile geometry: how a param's blocks lie in its shards (:class:`ShardBlocks`).

Kron and Shampoo precondition blocks of a param. Left to XLA, a block that spans several
devices' shards makes every factor update gather, transpose and scatter. Given the param's
spec and the mesh (:class:`~bv_sharding.optimizers.layout.ParamLayout`), :func:`shard_blocks`
says where each block's data is:

* dim ``k`` of a param with ``s_k`` shards has local extent ``e_k = d_k / s_k``; when
  it is a multiple of ``block_size`` (or the dim is not split) each shard holds whole
  tiles; shard-local blocks (``blocking="local"``) are ``min(block_size, e_k)`` long, a
  local extent that is not a multiple zero-padded inside its shard (a padded block acts
  like a smaller one);
* a param's block stacks are stored with its block grid as leading dims
  (:attr:`ShardBlocks.grid_shape`: a 2-D param's factor stack is ``(g_0, g_1, b, b)``, a scanned
  param's layers first), each block at its place in the param: the state is the same on
  any mesh. A stored stack reaches the per-block work in run order (:meth:`ShardBlocks.to_run`:
  shard-major, each shard's blocks as :func:`~bv_sharding.optimizers.tensor_ops.blockify`
  orders them), and back (:meth:`ShardBlocks.from_run`).

Same math on any mesh (``blocking="tiles"``, the default): the blocks are the param's own
grid of ``block_size`` tiles whatever the device count; where a tile spans several shards
its holders exchange what it needs (:attr:`ShardBlocks.owners`), or the param's arrays move
to a layout whose shards hold whole tiles (:attr:`ShardBlocks.relaid_from`), or it is pooled
with other params' tiles and dealt over the mesh (:attr:`ShardBlocks.pooled`). So a state saved on one
mesh is the state of any other, each factor still preconditioning its own tile.
``blocking="local"`` keeps blocks cut shard by shard: ``min(block_size, e_k)`` long, so
another mesh may give other tiles. :func:`same_blocking` tells whether two layouts give
the same tiles; when they do not, the factors of one layout do not fit the other's blocks
and a restore onto that mesh must re-initialise them.

Where the blocks run: :mod:`bv_sharding.optimizers.shard_run` (one param's, in
``shard_map``), :mod:`bv_sharding.optimizers.pools` (pooled tiles, dealt over the mesh),
:mod:`bv_sharding.optimizers.blocked` (every param's, in one go); where their stacks are
stored: :mod:`bv_sharding.optimizers.placement`.

Example:
    >>> blocks = ShardBlocks((8, 6), (2, 1), block_size=2)
    >>> blocks.local_shape, blocks.count, blocks.sizes
    ((4, 6), 12, (2, 2))
    >>> x = np.arange(48.0).reshape(8, 6)
    >>> stack = blocks.split(x)
    >>> stack.shape, bool((blocks.merge(stack) == x).all())
    ((12, 2, 2), True)
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from bv_sharding.errors import OptimizerError
from bv_sharding.ops import axis_size, stack_axes
from bv_sharding.optimizers.tensor_ops import blockify, unblockify

BLOCKINGS = ("tiles", "local")  # The param's fixed tile grid (default), or each shard's own blocks.


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
  owners, pooled, relaid_from = None, False, None
  if blocking == "tiles":
    whole = _whole_tiles(shape, shards_of(spec), block_size, scanned)
    owners = _owners(tuple(shape), spec, shards_of(spec), whole, block_size, scanned)
    # Tiles that span shards and no holder owns, or that a dealt piece would cut: pooled,
    # unless the param's axes all on one dim put whole tiles in every shard: relaid there.
    pooled = owners is None and (not all(whole) or (dealt is not None and not in_pieces))
    relaid = _relaid_spec(shape, spec, sizes, block_size, scanned) if pooled else None
    if relaid is not None:
      relaid_from, spec, pooled = spec, relaid, False
  shards = (1,) * len(shape) if pooled else shards_of(spec)
  # On a concrete mesh even a never-sharded param's blocks run in shard_map (whole on every
  # device): on global arrays XLA chose how to split their fit, and rematerialized it.
  concrete = isinstance(mesh, jax.sharding.Mesh)
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
      relaid_from,
  )


def _relaid_spec(shape, spec, sizes: dict[str, int], block_size: int, scanned: bool):
  """The spec with all of ``spec``'s mesh axes (in mesh order) on the first dim (not a scanned
  layer axis) whose shards they would cut into whole ``block_size`` tiles; None when no dim
  does, or ``spec`` names no axis.

  Example:
      >>> _relaid_spec((16, 6), (None, "data"), {"data": 2}, 4, False)  # 3 of a 4-tile's 6 columns
      ('data', None)
  """
  axes = [a for a in sizes if a in stack_axes(spec)]
  shards = math.prod(sizes[a] for a in axes)
  for dim in range(int(scanned), len(shape)) if axes else ():
    if shape[dim] % shards == 0 and (shape[dim] // shards) % block_size == 0:
      return tuple(spec_entry(axes) if d == dim else None for d in range(len(shape)))
  return None


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
  spec[dim] = spec_entry(axes)
  return tuple(spec)


@dataclasses.dataclass(frozen=True)
class ShardBlocks:
  """One param's shard-local blocking: ``shards`` per dim, blocks of ``block_size``.

  ``scanned``: dim 0 is a layer axis, blocked layer by layer (never cut).
  ``spec``/``mesh``: where the blocks run in ``shard_map`` (``mesh`` None: on global
  arrays; :func:`~bv_sharding.optimizers.shard_run.run_alone`). ``dealt``: the param is
  replicated and ``spec`` is virtual: every device holds the whole param, cuts it as ``spec``
  would shard it and works on its own piece's blocks; the pieces' results are gathered (a
  param's bytes).
  ``owners``: ``(dim, axis, holders)`` (``blocking="tiles"``): the tiles of ``dim``
  span ``holders`` consecutive shards of ``axis``, and each of those holders *owns* an
  equal share of the tiles they hold together: its stack slice holds their factors, the
  holders exchange the tiles' pieces (an all-to-all among them) so that each owner fits
  and applies its whole tiles, and send the directions' pieces back the same way.
  ``pooled``: where no such split exists (fewer tiles than holders, or tiles not aligned
  with the shards), the blocks are the param's global tile grid (``shards`` all 1, the
  one-device order) and :func:`~bv_sharding.optimizers.blocked.run_all` pools them with the
  other pooled params' tiles of the same shape into one stack split over every mesh axis
  (:mod:`bv_sharding.optimizers.pools`): each device fits and applies its ``1/N`` of all
  those tiles. XLA moves each array (a device's shard to its tiles' owners, and back) with
  all-to-alls and collective permutes of about a shard's bytes. The stacks of owned and
  pooled tiles are stored spread at the ideal
  (:func:`~bv_sharding.optimizers.placement.stored_spec`) and move the same way as the
  arrays.
  ``relaid_from``: the param's own spec, where its tiles would be pooled but its mesh axes all
  on one dim put whole tiles in every shard (a 2048-row head split on its 32000 columns, with
  8 devices and 256-tiles): ``spec`` is that layout, and the blocks are shard-local there. The
  param's arrays move to it (one all-to-all each, of about a shard's bytes) and their results
  back; the stacks are stored on it and never move.
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
  relaid_from: tuple | None = None

  @property
  def in_pool(self) -> bool:
    """Whether :func:`~bv_sharding.optimizers.blocked.run_all` pools these blocks (pooled, on a
    concrete mesh)."""
    return self.pooled and self.mesh is not None

  @property
  def relaid(self) -> bool:
    """Whether the blocks run in another layout than their param's (:attr:`relaid_from`), on a
    concrete mesh: its arrays move there and back."""
    return self.relaid_from is not None and self.mesh is not None

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
    return P(spec_entry(axes)) if axes else P()

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
    return tuple(s * c for s, c in zip(self.shards, self.per_shard))

  @property
  def per_shard(self) -> tuple[int, ...]:
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
    n, per = len(self.shards), self.per_shard
    split = stack.reshape(*[v for s, c in zip(self.shards, per) for v in (s, c)], *stack.shape[n:])
    order = [*range(0, 2 * n, 2), *range(1, 2 * n, 2), *range(2 * n, split.ndim)]
    return split.transpose(order).reshape(-1, *stack.shape[n:])

  def from_run(self, stack: jax.Array) -> jax.Array:
    """Inverse of :meth:`to_run`.

    Example:
        >>> blocks = ShardBlocks((8, 6), (2, 1), block_size=2)
        >>> x = np.arange(48.0).reshape(8, 6)
        >>> stored = blocks.from_run(blocks.split(x))  # each block's place in the param
        >>> stored.shape, bool((stored[1, 2] == x[2:4, 4:6]).all())
        ((4, 3, 2, 2), True)
    """
    if self.owners is not None:
      return self.whole_tiles.from_run(self._owner_order(stack, inverse=True))
    n, per = len(self.shards), self.per_shard
    split = stack.reshape(*self.shards, *per, *stack.shape[1:])
    order = [*(v for k in range(n) for v in (k, n + k)), *range(2 * n, split.ndim)]
    return split.transpose(order).reshape(*self.grid_shape, *stack.shape[1:])

  @property
  def shard_local(self) -> bool:
    """Whether each device holds the blocks of its own shard (or dealt piece): a stored stack
    takes the param's spec on its grid dims and reaches the blocks' run as it is stored."""
    return self.owners is None and not self.pooled

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


def spec_entry(axes: Sequence[str]):
  """A spec entry naming ``axes``: None, one axis, or a tuple of them.

  Example:
      >>> spec_entry(()), spec_entry(("data",)), spec_entry(("data", "model"))
      (None, 'data', ('data', 'model'))
  """
  return tuple(axes) if len(axes) > 1 else (axes[0] if axes else None)


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


def tiles_text(blocks: ShardBlocks | None) -> str:
  """A one-line description of a stack's blocks, for errors."""
  if blocks is None:
    return "no blocks"
  return f"{blocks.sizes} blocks of a {blocks.shape} param in {blocks.shards} shards"
