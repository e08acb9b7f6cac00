"""Gaussian probes drawn tile by tile, so that a pool draws its tiles where it fits them.

Kron fits each tile's factors with a Gaussian probe. A :class:`TileNormal` is one param's
probe: tile ``t`` of the param's tile grid (row-major over
:attr:`~bv_sharding.optimizers.tiles.ShardBlocks.grid_shape`) is
``jax.random.normal(jax.random.fold_in(key, t), tile)``, zero past the param's edges, and a
param of one tile draws ``jax.random.normal(key, shape)``, as psgd-jax does. The values depend
on the key and the tiles alone, never on the mesh. A pool draws its members' tiles in its own
layout, each device its own (:func:`pooled_tables`, :func:`from_tables`), and so do
shard-local blocks and the owners of tiles that span shards (:func:`in_shards`): the probe
never crosses the wire. Blocks computed
on global arrays, or on a never-sharded param's dealt pieces, take it param-shaped
(:func:`wholes`).

Example:
    >>> from bv_sharding.optimizers.tiles import ShardBlocks
    >>> blocks = ShardBlocks((6, 4), (1, 1), block_size=4)  # two tiles, the second half padding
    >>> probe = TileNormal(jax.random.split(jax.random.PRNGKey(0), 1), 0, jnp.float32)
    >>> [whole] = wholes([(probe, blocks)])
    >>> tables = pooled_tables([(probe, blocks)], 2, lambda x: x)
    >>> tiles = from_tables(tables, *pooled_like([(probe, blocks)]))
    >>> bool((blocks.split(whole) == tiles).all()), float(abs(tiles[1, 2:]).sum())
    (True, 0.0)
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from bv_sharding.ops import stack_axes
from bv_sharding.optimizers.tensor_ops import unblockify
from bv_sharding.optimizers.tiles import ShardBlocks


class TileNormal(NamedTuple):
  """A param's Gaussian probe of ``dtype``, drawn tile by tile from ``keys[index]`` (module
  docstring). ``keys`` holds every param's key (one update's), so that a pool picks its
  members' keys in one gather, not one slice each.

  Example:
      >>> key = jax.random.PRNGKey(0)
      >>> one_tile = ShardBlocks((3, 2), (1, 1), block_size=8)
      >>> [whole] = wholes([(TileNormal(key[None], 0, jnp.float32), one_tile)])
      >>> bool((whole == jax.random.normal(key, (3, 2))).all())
      True
  """

  keys: jax.Array
  index: int
  dtype: Any
  turned: bool = False  # Its param's pool runs its matrices transposed (blocked.turns).


def wholes(members: Sequence[tuple[TileNormal, ShardBlocks]]) -> list[jax.Array]:
  """Each member's probe, param-shaped: its tiles drawn and laid at their places in the param,
  padding cut; one RNG program for the members alike (the same blocks, sharded alike, and
  dtype). For blocks computed on global arrays or on dealt pieces of a never-sharded param:
  XLA does not split such a draw over a sharded param's shards (every device would draw every
  tile), so sharded params' tiles are drawn where they are fitted (:func:`in_shards`,
  :func:`pooled`)."""
  groups: dict[tuple, list[int]] = {}
  for i, (probe, blocks) in enumerate(members):
    groups.setdefault((blocks, probe.dtype), []).append(i)
  out: list = [None] * len(members)
  for (blocks, dtype), indices in groups.items():
    alike, count, sizes = [members[i] for i in indices], _count(blocks), blocks.sizes
    keys = _tile_keys(alike, [np.arange(count)] * len(alike))
    drawn = _normals(keys, sizes, dtype).reshape(len(alike), count, *sizes)
    for i, stack in zip(indices, drawn):
      out[i] = _in_place(stack, members[i][1])
  return out


def _in_place(stack: jax.Array, blocks: ShardBlocks) -> jax.Array:
  """A param's tiles, ``(count, *sizes)`` in grid order, laid at their places in the param."""
  lay = functools.partial(unblockify, block_size=blocks.block_size)
  if blocks.scanned:
    layers = blocks.shape[0]
    return jax.vmap(lambda s: lay(s, blocks.shape[1:]))(stack.reshape(layers, -1, *stack.shape[1:]))
  return lay(stack, blocks.shape)


def drawn_whole(runs: Sequence, keep: set[tuple[int, int]] = frozenset()) -> list:
  """``runs`` (:class:`~bv_sharding.optimizers.shard_run.BlockRun` or None) with each
  :class:`TileNormal` among their arrays drawn whole (:func:`wholes`, all in one go), but those
  at ``keep`` (``(run, array)`` indices), which a pool draws in place (:func:`pooled`).

  Example:
      >>> from bv_sharding.optimizers.shard_run import BlockRun
      >>> blocks = ShardBlocks((4, 2), (1, 1), block_size=2)
      >>> probe = TileNormal(jax.random.split(jax.random.PRNGKey(0), 1), 0, jnp.float32)
      >>> [run, _] = drawn_whole([BlockRun(blocks, None, [probe], ()), None])
      >>> run.arrays[0].shape
      (4, 2)
  """
  found = [
      (i, j)
      for i, run in enumerate(runs)
      if run is not None
      for j, a in enumerate(run.arrays)
      if isinstance(a, TileNormal) and (i, j) not in keep
  ]
  drawn = wholes([(runs[i].arrays[j], runs[i].blocks) for i, j in found])
  arrays = {i: list(runs[i].arrays) for i, _ in found}
  for (i, j), x in zip(found, drawn):
    arrays[i][j] = x
  return [run._replace(arrays=arrays[i]) if i in arrays else run for i, run in enumerate(runs)]


def pooled_tables(
    members: Sequence[tuple[TileNormal, ShardBlocks]],
    total: int,
    place: Callable[[jax.Array], jax.Array],
) -> tuple:
  """What the tiles of ``members`` (pooled blocks of one tile shape) are drawn from, one row per
  slot in run order, padded to ``total`` with copies of the last tile's key (padding draws
  zero): their keys (placed by ``place``, the pool's layout, so that each device draws its own
  slots' tiles with :func:`from_tables` where and when it reads them), extents inside their
  params, and whether each is turned (None where none is)."""
  order = [_probe_order(probe, b) for probe, b in members]
  # Padded in the tables (constants), not in the keys: padding a split array moves its edge.
  keys = place(_tile_keys(members, order, total))
  pad = lambda x: np.pad(x, [(0, total - len(x))] + [(0, 0)] * (x.ndim - 1), mode="edge")
  valid = pad(np.concatenate([_valid(blocks) for _, blocks in members]))
  turned = pad(np.repeat([probe.turned for probe, _ in members], [len(o) for o in order]))
  return keys, jnp.asarray(valid), jnp.asarray(turned) if turned.any() else None


def from_tables(tables: tuple, sizes: tuple[int, ...], dtype) -> jax.Array:
  """The tiles of :func:`pooled_tables`' rows ``tables`` (all of them, or a device's)."""
  keys, valid, turned = tables
  drawn = _normals(keys, sizes, dtype)
  if turned is not None:  # A turned tile is its own draw transposed (a draw's values fill it flat).
    flipped = drawn.reshape(len(keys), *sizes[::-1]).swapaxes(1, 2)
    drawn = jnp.where(turned.reshape(-1, 1, 1), flipped, drawn)
  return _inside(drawn, valid)


def pooled_like(members: Sequence[tuple[TileNormal, ShardBlocks]]) -> tuple:
  """The tile shape and dtype of the probes of ``members``: :func:`from_tables`' last
  arguments."""
  return members[0][1].sizes, members[0][0].dtype


def in_shards(members: Sequence[tuple[TileNormal, ShardBlocks]], keys: jax.Array) -> jax.Array:
  """Inside ``shard_map`` over each member's blocks' spec, shard-local or dealt to owners
  (``keys``: the members' :attr:`TileNormal.keys`, passed in whole): the tiles of every
  member's probe that this device fits, one member after another, each in its run order
  (:meth:`~bv_sharding.optimizers.tiles.ShardBlocks.to_run`, which also orders the factors it
  fits them with); one RNG program for them all, each device drawing its own tiles."""
  found = [_device_tiles(blocks) for _, blocks in members]
  drawn = _normals(
      _tile_keys(members, [t for t, _ in found], keys=keys),
      members[0][1].sizes,
      members[0][0].dtype,
  )
  return _inside(drawn, jnp.concatenate([v for _, v in found]))


def _device_tiles(blocks: ShardBlocks) -> tuple[jax.Array, jax.Array]:
  """Inside ``shard_map`` over ``blocks``' spec: the grid indices of the tiles this device fits
  (``(n,)``, its share of the run order, picked from a table of every device's) and their
  extents inside the param (``(n, k)``)."""
  axes = stack_axes(blocks.spec)
  table = _run_order(blocks).reshape(math.prod(blocks.shards), -1)
  device = jax.lax.axis_index(axes) if axes else 0
  return jnp.asarray(table)[device], jnp.asarray(_valid(blocks)[table])[device]


def _inside(drawn: jax.Array, valid) -> jax.Array:
  """Tiles ``drawn`` ``(n, *sizes)`` zero past each one's extents ``valid`` ``(n, k)``."""
  sizes = drawn.shape[1:]
  inside = [
      jax.lax.broadcasted_iota(jnp.int32, drawn.shape, 1 + d)
      < valid[:, d].reshape(-1, *(1,) * len(sizes))
      for d in range(len(sizes))
  ]
  return jnp.where(functools.reduce(jnp.logical_and, inside), drawn, 0)


def _run_order(blocks: ShardBlocks) -> np.ndarray:
  """The grid indices of ``blocks``' tiles in their run order
  (:meth:`~bv_sharding.optimizers.tiles.ShardBlocks.to_run`)."""
  return np.asarray(blocks.to_run(np.arange(_count(blocks)).reshape(blocks.grid_shape)))


def _probe_order(probe: TileNormal, blocks: ShardBlocks) -> np.ndarray:
  """The grid indices in its param of the tiles of ``probe`` in their run order on ``blocks``:
  where the run is turned (``blocks`` those of the transposed param, or of a stack of layers'
  transposed matrices), each turned tile's index in the param's own grid.

  Example:
      >>> blocks = ShardBlocks((4, 6), (1, 1), block_size=2)  # The turned grid of a 6 x 4 param.
      >>> probe = TileNormal(None, 0, jnp.float32, turned=True)
      >>> _probe_order(probe, blocks).tolist()  # The param's grid is 3 x 2, read by columns.
      [0, 2, 4, 1, 3, 5]
  """
  order = _run_order(blocks)
  if not probe.turned:
    return order
  *layers, rows, cols = blocks.grid_shape
  own = np.arange(_count(blocks)).reshape(*layers, cols, rows)
  return np.swapaxes(own, -1, -2).ravel()[order]


def _count(blocks: ShardBlocks) -> int:
  """The tiles of ``blocks``' grid."""
  return math.prod(blocks.grid_shape)


def _tile_keys(
    members: Sequence[tuple[TileNormal, ShardBlocks]],
    order: Sequence,
    total: int | None = None,
    keys: jax.Array | None = None,
) -> jax.Array:
  """The keys of each member's tiles (``order``: their grid indices, in the order wanted), one
  member after another, repeating the last to ``total``: ``fold_in(key, t)`` for tile ``t``,
  ``key`` itself for a param of one tile; one program for them all, the members' keys picked
  in one gather (from ``keys``, or their own)."""
  member = np.repeat(np.arange(len(members)), [len(o) for o in order])
  tile = np.concatenate(order) if total is not None else jnp.concatenate(order)
  if total is not None:
    member, tile = (np.pad(x, (0, total - len(x)), mode="edge") for x in (member, tile))
  rows = np.array([probe.index for probe, _ in members])[member]
  own = members[0][0].keys
  assert all(probe.keys is own for probe, _ in members), "probes of one update's keys"
  base = (own if keys is None else keys)[rows]
  alone = np.array([_count(b) == 1 for _, b in members])[member].reshape(-1, 1)
  return jnp.where(alone, base, jax.vmap(jax.random.fold_in)(base, tile))


def _normals(keys: jax.Array, sizes: tuple[int, ...], dtype) -> jax.Array:
  """One draw of ``sizes`` per key."""
  return jax.vmap(lambda k: jax.random.normal(k, sizes, dtype))(keys)


def _valid(blocks: ShardBlocks) -> np.ndarray:
  """Per tile in grid order (a pool's run order), its extent inside the param along each tile
  dim: ``(count, k)``; the param's tile grid is padded at its far edges alone."""
  dims = blocks.shape[int(blocks.scanned) :]
  per_dim = [
      [min(size, extent - start) for start in starts]
      for extent, size, starts in zip(dims, blocks.sizes, blocks.tiles())
  ]
  grid = np.stack(np.meshgrid(*per_dim, indexing="ij"), -1).reshape(-1, len(dims))
  layers = blocks.shape[0] if blocks.scanned else 1
  return np.tile(grid, (layers, 1)).astype(np.int32)
