"""Pools that keep their state where they run: which pools, and the way between a param's own
state and its pool's.

A pooled tile is fitted whole by one device (:mod:`~bv_sharding.optimizers.pools`). Its
param's state, stored spread over the mesh (one leaf per param, the same on any mesh), moves
to that device and back every step. A pool held where it runs keeps its members' state in one
:class:`~bv_sharding.optimizers.pools.Resident` instead: one array per kind of state, a slot
per tile, split over every device on its slots. The step then moves only the gradient's and
the direction's pieces; the state takes the pool's padding and its shapes depend on the mesh.
:func:`held_pools` picks the pools worth it (their padding within a bound), :class:`Seat` says
where a member's tiles sit, and :func:`to_slots` / :func:`from_slots` carry a param's arrays and
factor stacks into its slots and back, so that an optimizer can give its state in the form that
is the same on any mesh (:func:`~bv_sharding.optimizers.portable.canonical_state`).

Example:
    >>> from bv_sharding.optimizers.placement import Tiling
    >>> mesh = jax.sharding.AbstractMesh((4,), ("data",))
    >>> blocks = Tiling(4).blocks((16, 8), ("data", None), mesh)  # 4 x 8 shards of 4-tiles
    >>> blocks.pooled
    False
    >>> tall = Tiling(8).blocks((16, 8), ("data", None), mesh)  # 8-tiles span 2 shards each
    >>> run = BlockRun(tall, None, [], [], turnable=True)
    >>> [(pool.members, slots) for pool, slots in held_pools([run, run], 4, 1.0)]
    [([0, 1], 4)]
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from bv_sharding.ops import stack_axes
from bv_sharding.optimizers import moves
from bv_sharding.optimizers.blocked import PoolPlan, pools_of, swapped, turned_blocks
from bv_sharding.optimizers.placement import Stacks, spread
from bv_sharding.optimizers.pools import padded, slot_count
from bv_sharding.optimizers.shard_run import BlockRun
from bv_sharding.optimizers.tiles import ShardBlocks, spec_entry


class Seat(NamedTuple):
  """Where a param's tiles sit in its pool: its leaf (index in the params' leaves), its first
  slot, and whether the pool runs it turned (its tiles transposed)."""

  leaf: int
  start: int
  turned: bool


def held_pools(runs: Sequence[BlockRun | None], devices: int, padding: float) -> list:
  """``(pool, slots)`` of each pool :func:`~bv_sharding.optimizers.blocked.run_all` forms of
  ``runs`` (:func:`~bv_sharding.optimizers.blocked.pools_of`) whose slots, its tiles padded
  to a multiple of ``devices``, are at most ``padding`` times its tiles (0: none is held)."""
  held = []
  for pool in pools_of(runs) if padding else ():
    tiles = sum(b.count for b in pool.blocks)
    slots = slot_count(tiles, devices)
    if slots <= padding * tiles:
      held.append((pool, slots))
  return held


def seats(pool: PoolPlan) -> tuple[Seat, ...]:
  """Each member's :class:`Seat`, in the pool's order.

  Example:
      >>> from bv_sharding.optimizers.tiles import ShardBlocks
      >>> blocks = [ShardBlocks((4, 4), (1, 1), 2), ShardBlocks((2, 4), (1, 1), 2)]
      >>> seats(PoolPlan([3, 1], blocks, [False, True]))
      (Seat(leaf=3, start=0, turned=False), Seat(leaf=1, start=4, turned=True))
  """
  return tuple(Seat(*s) for s in zip(pool.members, pool.starts, pool.turned))


def _as_run(blocks: ShardBlocks, seat: Seat) -> ShardBlocks:
  return turned_blocks(blocks) if seat.turned else blocks


def to_slots(x: jax.Array, blocks: ShardBlocks, seat: Seat) -> jax.Array:
  """A param-shaped ``x`` (its param cut as ``blocks``) as its tiles in its pool's slots,
  ``(count, *tile)``, turned as the pool runs them.

  Example:
      >>> from bv_sharding.optimizers.tiles import ShardBlocks
      >>> x = jnp.arange(8.0).reshape(4, 2)
      >>> to_slots(x, ShardBlocks((4, 2), (1, 1), 4, spec=(None, None)), Seat(0, 0, True)).shape
      (1, 2, 4)
  """
  x = x.reshape(blocks.shape)
  return _as_run(blocks, seat).split(jnp.swapaxes(x, -1, -2) if seat.turned else x)


def from_slots(tiles: jax.Array, blocks: ShardBlocks, seat: Seat, shape) -> jax.Array:
  """Inverse of :func:`to_slots`: the param of ``shape`` from its tiles.

  Example:
      >>> from bv_sharding.optimizers.tiles import ShardBlocks
      >>> x, seat = jnp.arange(8.0).reshape(4, 2), Seat(0, 0, True)
      >>> blocks = ShardBlocks((4, 2), (1, 1), 4, spec=(None, None))
      >>> bool((from_slots(to_slots(x, blocks, seat), blocks, seat, (4, 2)) == x).all())
      True
  """
  x = _as_run(blocks, seat).merge(tiles)
  return (jnp.swapaxes(x, -1, -2) if seat.turned else x).reshape(shape)


def stacks_to_slots(stacks: Stacks, blocks: ShardBlocks, seat: Seat) -> list[jax.Array]:
  """A param's per-dim factor stacks (stored) as its pool's slots: ``(count, ...)`` each, its
  dims' order reversed and each tile's grid turned where the pool runs it turned."""
  grid = [stacks.tiling.grid_form(x, blocks) for x in stacks]
  if seat.turned:
    grid = swapped([grid], len(blocks.grid_shape))[0]
  return [_as_run(blocks, seat).to_run(x) for x in grid]


def stacks_from_slots(
    slots: Sequence[jax.Array], blocks: ShardBlocks, seat: Seat, tiling
) -> Stacks:
  """Inverse of :func:`stacks_to_slots`: the param's stored stacks from its slots."""
  grid = [_as_run(blocks, seat).from_run(x) for x in slots]
  if seat.turned:
    grid = swapped([grid], len(blocks.grid_shape))[0]
  return Stacks([tiling.stored_form(x, blocks) for x in grid], tiling)


def pooled(parts: Sequence[jax.Array], like, mesh) -> jax.Array:
  """The members' slots (in the pool's order) as the pool's array ``like`` (its slots, dtype):
  joined where each is spread over the mesh (:func:`spread_slots`), padded with copies of the
  last tile (as a pool pads what moves in) and moved to the pool's layout (:func:`dealt_slots`).

  Example:
      >>> like = jax.ShapeDtypeStruct((4, 3), jnp.float32)
      >>> pooled([jnp.ones((2, 3)), jnp.zeros((1, 3))], like, None)[:, 0].tolist()
      [1.0, 1.0, 0.0, 0.0]
  """
  joined = jnp.concatenate([spread_slots(x, mesh) for x in parts])
  return dealt_slots(padded(joined, like.shape[0]), mesh).astype(like.dtype)


def spread_slots(x: jax.Array, mesh) -> jax.Array:
  """A pool's array ``(slots, ...)`` (or its members' slots) split over every mesh axis along
  its own dims instead of its slots, as a stored stack is
  (:func:`~bv_sharding.optimizers.placement.spread`): reading a member's slots, or joining
  them, is then local, and the way to or from the pool's layout one all-to-all
  (:func:`dealt_slots`). On a concrete ``mesh`` (inside ``jit``); elsewhere ``x`` as it is."""
  if not isinstance(mesh, jax.sharding.Mesh):
    return x
  sizes = dict(mesh.shape)
  return _placed(x, mesh, (None, *spread(x.shape[1:], stack_axes((), sizes), sizes)))


def dealt_slots(x: jax.Array, mesh) -> jax.Array:
  """A pool's array moved from :func:`spread_slots`'s layout to the pool's (its slots split
  over every mesh axis), one run of axes at a time (:func:`~bv_sharding.optimizers.moves.move`).
  On a concrete ``mesh`` (inside ``jit``); elsewhere ``x`` as it is."""
  return _dealt(x, mesh, back=False)


def undealt_slots(x: jax.Array, mesh) -> jax.Array:
  """A pool's array moved from its layout to :func:`spread_slots`'s (inverse of
  :func:`dealt_slots`)."""
  return _dealt(x, mesh, back=True)


def _dealt(x: jax.Array, mesh, back: bool) -> jax.Array:
  if not isinstance(mesh, jax.sharding.Mesh):
    return x
  sizes = dict(mesh.shape)
  axes = stack_axes((), sizes)
  spread_spec = (None, *spread(x.shape[1:], axes, sizes))
  dealt_spec = (spec_entry(axes), *(None,) * (x.ndim - 1))
  src, dst = (dealt_spec, spread_spec) if back else (spread_spec, dealt_spec)
  return moves.move(x, mesh, src, dst)


def _placed(x: jax.Array, mesh, spec) -> jax.Array:
  return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(*spec)))


def member_slots(x: jax.Array, blocks: ShardBlocks, seat: Seat) -> jax.Array:
  """A member's slots of a pool's array ``x`` (``(slots, ...)``)."""
  return jax.lax.slice_in_dim(x, seat.start, seat.start + blocks.count)


def devices_of(mesh) -> int:
  """The device count of ``mesh`` (a ``Mesh`` or an ``AbstractMesh``)."""
  return math.prod(dict(mesh.shape).values())
