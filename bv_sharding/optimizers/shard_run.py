"""Running one param's blocks where they live: in ``jax.shard_map`` over the param's spec.

A :class:`BlockRun` is one param's per-block work: ``fn`` on the blocks of ``arrays``
(param-shaped: a gradient, a momentum, a probe) and on the param's block ``stacks`` (its
factors, stored ``(*grid, ...)``: :mod:`bv_sharding.optimizers.placement`). On a concrete
``Mesh``, :func:`run_alone` runs it in ``jax.shard_map`` over the param's spec:

* shard-local blocks: each device the blocks of its own shard, its stored stacks a reshape
  away from their run order: no collective but the scalars computed outside (norms, counters);
* a dealt param (never sharded, cut into one piece per device): each device the blocks of its
  piece, the pieces' results gathered;
* tiles dealt to owners among their holders
  (:attr:`~bv_sharding.optimizers.tiles.ShardBlocks.owners`): the holders exchange the tiles'
  pieces so that each owner fits and applies whole tiles, and send the results back.

On an ``AbstractMesh`` (or without a layout) the same blocks are computed on global arrays:
the unsharded reference, and shapes for planning. Pooled tiles run with other params' in
:mod:`bv_sharding.optimizers.pools`; :func:`~bv_sharding.optimizers.blocked.run_all` runs
every param's.

Example:
    >>> blocks = ShardBlocks((8, 6), (2, 1), block_size=2)  # no mesh: on global arrays
    >>> fn = lambda arrays, stacks: ([-arrays[0]], [s + 1 for s in stacks])
    >>> (out,), (q,) = run_alone(BlockRun(blocks, fn, [jnp.ones((8, 6))], [jnp.zeros((4, 3))]))
    >>> out.shape, q.shape, float(q.sum())
    ((8, 6), (4, 3), 12.0)
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from bv_sharding.ops import stack_axes
from bv_sharding.optimizers import draws
from bv_sharding.optimizers.placement import stored, stored_spec
from bv_sharding.optimizers.tiles import ShardBlocks, spec_entry


class BlockRun(NamedTuple):
  """One param's per-block work: ``fn(block_stacks, stacks, *scalars) -> (out_block_stacks,
  new_stacks)`` on the blocks of ``arrays`` and on ``stacks`` (see :func:`run_alone`).

  ``read_when`` (one entry per array) and ``write_when`` (one per entry of ``stacks``) name
  work a step may skip: an entry that is a boolean scalar, not None, says that ``fn`` reads
  that array only on the steps where it is true (it gets zeros on the others), or returns
  that stack changed only on those steps (unchanged on the others). On an accelerator a pool
  moves such an array in, and such a stack back, only on those steps, under ``lax.cond``
  (:func:`~bv_sharding.optimizers.pools.run_pool`; on CPU devices every step, the flag
  picking: :mod:`~bv_sharding.optimizers.gating`). Kron's fit, on its update steps, is
  one.

  An array that is a :class:`~bv_sharding.optimizers.draws.TileNormal` (a probe) and that
  the runner draws where the blocks run reaches ``fn`` as a function that draws its blocks:
  ``fn`` calls it where it reads them, so a step that does not (Kron's between its fits, under
  ``lax.cond``) draws nothing. Drawn elsewhere, it reaches ``fn`` as its blocks.

  ``turnable``: ``fn`` does the same work on a 2-D tile's transpose when each entry of
  ``stacks`` is a list of per-dim factor stacks and that list is reversed (Kron's and
  Shampoo's tiles, and SOAP's where it rotates both dims: their factors are per dim alike). A
  pooled run may then run turned (:func:`~bv_sharding.optimizers.blocked.turns`).

  ``squares``: the outs whose sum of squares over the whole param (float32) the run wants
  too: :func:`~bv_sharding.optimizers.blocked.run_all` returns them after its outs (a pool
  sums its tiles' squares once for all its params, where each param's own sum is a kernel
  per param shape). The padding of a partial tile must come out zero.

  ``resident``: the state of the pool this pooled run joins, kept where the pool runs it (a
  tree of ``(slots, ...)`` arrays split over every mesh axis on their dim 0, one slot per
  tile, :mod:`~bv_sharding.optimizers.pools`); every run of the pool gives the same object
  and has no ``stacks`` of its own. ``fn`` gets each device's slots of it as its stacks, and
  the run's new stacks are the pool's new state.
  """

  blocks: ShardBlocks
  fn: Callable
  arrays: Sequence[jax.Array]
  stacks: Any
  scalars: Sequence[jax.Array] = ()
  read_when: Sequence[jax.Array | None] = ()
  write_when: Sequence[jax.Array | None] = ()
  turnable: bool = False
  squares: Sequence[int] = ()
  resident: Any = None


def run_alone(run: BlockRun) -> tuple[list[jax.Array], Any]:
  """``(outs, new_stacks)`` of ``run``, whose blocks are not pooled with others'
  (:func:`~bv_sharding.optimizers.blocked.run_all` calls it).

  ``fn(block_stacks, stacks, *scalars) -> (out_block_stacks, new_stacks)`` per shard: the
  ``arrays`` are param-shaped and split into blocks for ``fn``, its outputs merged back to
  param shape; ``stacks`` go in and come back stored. On a mesh this is a ``shard_map`` over
  the blocks' spec, the scalars replicated (shard-local blocks: :func:`run_together` of one
  run).

  Example:
      >>> double = lambda arrays, stacks: ([2 * arrays[0]], stacks)
      >>> blocks = ShardBlocks((4, 4), (1, 1), block_size=2)
      >>> (out,), _ = run_alone(BlockRun(blocks, double, [jnp.ones((4, 4))], ()))
      >>> float(out.sum())
      32.0
  """
  blocks, fn, arrays, stacks, scalars = run[:5]
  if blocks.mesh is None:
    run_order = jax.tree.map(blocks.to_run, stacks)
    outs, new_stacks = fn([blocks.split(x) for x in arrays], run_order, *scalars)
    return [blocks.merge(o) for o in outs], jax.tree.map(blocks.from_run, new_stacks)
  if blocks.owners is not None:
    return _run_owned(blocks, fn, arrays, stacks, scalars)
  if blocks.dealt:
    return _run_dealt(blocks, _on_stored(blocks, fn), arrays, stacks, scalars)
  return run_together([run])[0]


def run_together(runs: Sequence[BlockRun]) -> list[tuple[list[jax.Array], Any]]:
  """Each run's ``(outs, new_stacks)``, as :func:`run_alone` gives them, for runs of
  shard-local blocks that share ``fn``, the tile shape and their stacks' shapes and dtypes
  (:func:`~bv_sharding.optimizers.pools.pool_key`): one ``shard_map`` in which each device
  joins its blocks of every run into one stack and calls ``fn`` once. ``fn`` works block by
  block (pools join tiles of several params the same way), so each block's result is the one
  it gets alone; the program holds one copy of ``fn`` instead of one per param. A scalar every
  run passes as the same object stays a scalar; others reach ``fn`` as one value per block.

  A probe that is a :class:`~bv_sharding.optimizers.draws.TileNormal` in every run is drawn
  here, each device its own tiles (:func:`~bv_sharding.optimizers.draws.in_shards`), when
  ``fn`` calls it (see :class:`BlockRun`).

  Example:
      >>> mesh = jax.make_mesh((2,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
      >>> fn = lambda arrays, stacks, s: ([arrays[0] * s[:, None, None]], stacks)
      >>> blocks = ShardBlocks((4, 4), (2, 1), 2, spec=("data", None), mesh=mesh)
      >>> one, two = (BlockRun(blocks, fn, [jnp.ones((4, 4))], (), [jnp.float32(k)]) for k in (1, 2))
      >>> [float(outs[0].sum()) for outs, _ in run_together([one, two])]
      [16.0, 32.0]
  """
  first = runs[0]
  shared = [all(r.scalars[k] is v for r in runs) for k, v in enumerate(first.scalars)]
  leading = lambda r: len(r.blocks.shards)
  probes = [j for j, x in enumerate(first.arrays) if isinstance(x, draws.TileNormal)]
  keys = first.arrays[probes[0]].keys if probes else None

  def body(arrays, stacks, scalars, keys):
    cut = [
        [None if j in probes else r.blocks.split(x, local=True) for j, x in enumerate(xs)]
        for r, xs in zip(runs, arrays)
    ]
    ordered = [
        jax.tree.map(lambda x, r=r: x.reshape(-1, *x.shape[leading(r) :]), s)
        for r, s in zip(runs, stacks)
    ]
    counts = [math.prod(r.blocks.per_shard) for r in runs]
    drawn = lambda j: functools.partial(
        draws.in_shards, [(r.arrays[j], r.blocks) for r in runs], keys
    )
    values = [
        v
        if same
        else jnp.concatenate([jnp.broadcast_to(s[k], (n,)) for s, n in zip(scalars, counts)])
        for k, (v, same) in enumerate(zip(scalars[0], shared))
    ]
    join = lambda *parts: jnp.concatenate(parts)
    joined = [drawn(j) if j in probes else join(*parts) for j, parts in enumerate(zip(*cut))]
    outs, new = first.fn(joined, jax.tree.map(join, *ordered), *values)
    starts = [0, *itertools.accumulate(counts)]
    results = []
    for r, start, end in zip(runs, starts, starts[1:]):
      mine = lambda x, r=r, start=start, end=end: x[start:end].reshape(
          *r.blocks.per_shard, *x.shape[1:]
      )
      merged = [r.blocks.merge(o[start:end], local=True) for o in outs]
      results.append((merged, jax.tree.map(mine, new)))
    return results

  specs = [P(*r.blocks.spec) for r in runs]  # A stored stack's grid dims too.
  mapped = jax.shard_map(
      body,
      mesh=first.blocks.mesh,
      in_specs=(specs, specs, P(), P()),
      out_specs=[(spec, spec) for spec in specs],
      check_vma=False,
  )
  arrays = [[None if j in probes else x for j, x in enumerate(r.arrays)] for r in runs]
  results = mapped(arrays, [r.stacks for r in runs], [list(r.scalars) for r in runs], keys)
  return [(list(outs), new) for outs, new in results]


def _on_stored(blocks: ShardBlocks, fn: Callable) -> Callable:
  """``fn`` of run-order stacks as a function of one device's stored stacks (in
  ``shard_map``): its blocks' factors, a reshape away from its run order."""
  per, n = blocks.per_shard, len(blocks.shards)

  def on_stored(arrays, stacks, *scalars):
    outs, new_stacks = fn(
        arrays, jax.tree.map(lambda x: x.reshape(-1, *x.shape[n:]), stacks), *scalars
    )
    return outs, jax.tree.map(lambda x: x.reshape(*per, *x.shape[1:]), new_stacks)

  return on_stored


def _run_dealt(blocks: ShardBlocks, fn: Callable, arrays, stacks, scalars):
  """A dealt param's run: each device the blocks of its piece, results gathered."""
  axes = stack_axes(blocks.spec)
  per_device = blocks.count // math.prod(blocks.shards)

  def body(arrays, stacks, scalars):
    start = jax.lax.axis_index(axes) * per_device
    mine = [jax.lax.dynamic_slice_in_dim(blocks.split(x), start, per_device) for x in arrays]
    return fn(mine, stacks, *scalars)

  mapped = jax.shard_map(
      body,
      mesh=blocks.mesh,
      in_specs=(P(), P(*blocks.spec), P()),
      out_specs=(blocks.stack_spec, P(*blocks.spec)),
      check_vma=False,
  )
  outs, new_stacks = mapped(list(arrays), stacks, list(scalars))
  return [blocks.merge(o) for o in outs], new_stacks


def _run_owned(blocks: ShardBlocks, fn: Callable, arrays, stacks, scalars):
  """A run with :attr:`~bv_sharding.optimizers.tiles.ShardBlocks.owners`: pieces of tiles to
  their owners and back (a probe that is a
  :class:`~bv_sharding.optimizers.draws.TileNormal` drawn by the owners, each its own tiles)."""
  dim, axis, holders = blocks.owners
  block_dim = 1 + dim - int(blocks.scanned)  # The dim in a (n, *sizes) stack.
  size = dict(blocks.mesh.shape)[axis]

  def to_owners(pieces):  # (n_local, *piece) -> (n_local / holders, *tile)
    chunks = pieces.reshape(holders, -1, *pieces.shape[1:])  # Chunk r: what r owns.
    got = jnp.moveaxis(_exchange(chunks, axis, holders, size), 0, block_dim)
    return got.reshape(*got.shape[:block_dim], -1, *got.shape[block_dim + 2 :])

  def from_owners(tiles):
    rows = tiles.shape[block_dim] // holders
    parts = tiles.reshape(*tiles.shape[:block_dim], holders, rows, *tiles.shape[block_dim + 1 :])
    back = _exchange(jnp.moveaxis(parts, block_dim, 0), axis, holders, size)
    return back.reshape(-1, *back.shape[2:])

  sizes, axes, grid = dict(blocks.mesh.shape), stack_axes(blocks.spec), len(blocks.grid_shape)
  leaves, treedef = jax.tree.flatten(stacks)
  specs = [stored_spec(blocks, x.shape, sizes) for x in leaves]
  # The tail dim of each stored stack that holds all the param's axes: one all-to-all moves
  # it to its owners' run order (dim 0 over those axes), and back. Else XLA moves it.
  dims = [next((d for d, e in enumerate(s) if e == spec_entry(axes)), None) for s in specs]
  by_exchange = all(d is not None for d in dims)

  # In shard_map: a stored stack in run order, and back (each its own way: see above).
  there = lambda x, d: jax.lax.all_to_all(blocks.to_run(x), axes, 0, 1 + d - grid, tiled=True)
  back = lambda x, d: blocks.from_run(jax.lax.all_to_all(x, axes, 1 + d - grid, 0, tiled=True))
  if not by_exchange:
    there = back = lambda x, d: x
    specs, leaves = [blocks.stack_spec] * len(leaves), [blocks.to_run(x) for x in leaves]

  probes = [j for j, x in enumerate(arrays) if isinstance(x, draws.TileNormal)]
  keys = arrays[probes[0]].keys if probes else None
  owned = lambda j, x, keys: (
      functools.partial(draws.in_shards, [(arrays[j], blocks)], keys)
      if j in probes
      else to_owners(blocks.split(x, local=True))
  )

  def body(pieces, leaves, scalars, keys):
    tiles = [owned(j, x, keys) for j, x in enumerate(pieces)]
    stacks = treedef.unflatten([there(x, d) for x, d in zip(leaves, dims)])
    outs, new_stacks = fn(tiles, stacks, *scalars)
    new_leaves = [back(x, d) for x, d in zip(jax.tree.leaves(new_stacks), dims)]
    return [blocks.merge(from_owners(o), local=True) for o in outs], new_leaves

  param = P(*blocks.spec)
  mapped = jax.shard_map(
      body,
      mesh=blocks.mesh,
      in_specs=(param, specs, P(), P()),
      out_specs=(param, specs),
      check_vma=False,
  )
  pieces = [None if j in probes else x for j, x in enumerate(arrays)]
  outs, new_leaves = mapped(pieces, leaves, list(scalars), keys)
  if not by_exchange:
    new_leaves = [blocks.from_run(x) for x in new_leaves]
  return outs, stored(blocks, treedef.unflatten(new_leaves))


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
