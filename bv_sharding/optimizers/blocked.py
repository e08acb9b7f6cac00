"""Blocked preconditioners: the skeleton Kron and Shampoo share.

A blocked preconditioner cuts each param into blocks on the params' layout (its
:class:`~bv_sharding.optimizers.placement.Tiling`, :func:`param_blocks`), keeps one stack of
factors per block dim in its state, born with the param's block grid first
(:func:`grid_stacks`: a :class:`~bv_sharding.optimizers.placement.Stacks` node, placed by the
plan), and each step runs every param's per-block work in one go (:func:`run_blocked`): the
param-shaped arrays are cut into blocks where they live, the work runs on them and on the
factors (:mod:`bv_sharding.optimizers.shard_run`, or pooled over the mesh:
:mod:`bv_sharding.optimizers.pools`; :func:`run_all`), and the results come back param-shaped,
the new factors stored. :func:`transformation` makes the optax transformation and
:func:`with_learning_rate` the full optimizer.

Example:
    >>> from bv_sharding.optimizers.placement import Tiling
    >>> params = {"w": jnp.ones((4, 4))}
    >>> [blocks] = param_blocks(params, None, [Tiling(2)])
    >>> qs = grid_stacks([jnp.eye(2), jnp.eye(2)], blocks, Tiling(2))
    >>> [q.shape for q in qs]
    [(2, 2, 2, 2), (2, 2, 2, 2)]
    >>> double = lambda arrays, stacks: ([2 * arrays[0]], stacks)
    >>> [((out,), new)] = run_blocked([BlockRun(blocks, double, [params["w"]], [qs])])
    >>> float(out.sum()), new[0].tiling == qs.tiling
    (32.0, True)
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from bv_sharding.errors import OptimizerError
from bv_sharding.ops import stack_axes
from bv_sharding.optimizers import moves
from bv_sharding.optimizers.draws import TileNormal, drawn_whole
from bv_sharding.optimizers.layout import ParamLayout
from bv_sharding.optimizers.placement import Stacks, Tiling
from bv_sharding.optimizers.pools import drawn_in_place, like_groups, pool_key, run_pools
from bv_sharding.optimizers.shard_run import BlockRun, run_alone, run_together
from bv_sharding.optimizers.tiles import BLOCKINGS, ShardBlocks


def transformation(init: Callable, update: Callable, settings) -> optax.GradientTransformation:
  """``init(params, settings=)`` and ``update(updates, state, params, settings=)`` as an optax
  transformation, once ``settings.blocking`` is known.

  Example:
      >>> from types import SimpleNamespace
      >>> transformation(None, None, SimpleNamespace(blocking="rows"))
      Traceback (most recent call last):
      ...
      bv_sharding.errors.OptimizerError: blocking='rows'; expected one of ('tiles', 'local')
  """
  if settings.blocking not in BLOCKINGS:
    raise OptimizerError(f"blocking={settings.blocking!r}; expected one of {BLOCKINGS}")
  return optax.GradientTransformation(
      functools.partial(init, settings=settings),
      functools.partial(update, settings=settings),
  )


def with_learning_rate(
    tx: optax.GradientTransformation, learning_rate, weight_decay: float, mask
) -> optax.GradientTransformation:
  """The full optimizer of a ``scale_by_*`` transformation ``tx``: ``tx``, decoupled weight
  decay (``mask``: the params that get it) and the learning rate.

  Example:
      >>> tx = with_learning_rate(optax.identity(), 0.5, 1.0, None)
      >>> params = {"w": jnp.ones(2)}
      >>> tx.update(params, tx.init(params), params)[0]["w"].tolist()  # -0.5 * (1 + 1.0 * 1)
      [-1.0, -1.0]
  """
  return optax.chain(
      tx,
      optax.add_decayed_weights(weight_decay, mask),
      optax.scale_by_learning_rate(learning_rate),
  )


def param_blocks(
    params, layout: ParamLayout | None, tilings: Sequence[Tiling | None]
) -> list[ShardBlocks | None]:
  """Each leaf's blocks, cut by its tiling (None: not blocked) on ``layout``'s spec and mesh
  (``layout`` None: the param one shard), flattened like ``params``."""
  leaves, treedef = jax.tree.flatten(params)
  specs = [()] * len(leaves) if layout is None else treedef.flatten_up_to(layout.specs)
  mesh = None if layout is None else layout.mesh
  return [
      None if tiling is None else tiling.blocks(x.shape, spec, mesh)
      for x, spec, tiling in zip(leaves, specs, tilings)
  ]


def grid_stacks(factors: Sequence[jax.Array], blocks: ShardBlocks, tiling: Tiling) -> Stacks:
  """Each of one block's ``factors`` for every block: ``(*grid, *factor)`` stacks, in their
  stored form (:meth:`~bv_sharding.optimizers.placement.Tiling.stored_form`)."""
  grid = lambda f: jnp.broadcast_to(f, (*blocks.grid_shape, *f.shape))
  return Stacks([tiling.stored_form(grid(f), blocks) for f in factors], tiling)


def run_blocked(
    runs: Sequence[BlockRun | None],
) -> list[tuple[list[jax.Array], list[Stacks]] | None]:
  """:func:`run_all` of runs whose ``stacks`` are a sequence of :class:`Stacks`: each run's
  ``(outs, new stacks)``, each new stack a :class:`Stacks` with its old one's tiling (the
  stacks run in their grid form and are kept in their stored one); a resident run's new
  stacks are its pool's new state, as they come."""
  grid = lambda r: [[s.tiling.grid_form(x, r.blocks) for x in s] for s in r.stacks]
  bare = [None if r is None else r._replace(stacks=grid(r)) for r in runs]
  stored = lambda new, old, blocks: Stacks(
      [old.tiling.stored_form(x, blocks) for x in new], old.tiling
  )
  return [
      result
      if result is None or run.resident is not None
      else (result[0], [stored(new, old, run.blocks) for new, old in zip(result[1], run.stacks)])
      for run, result in zip(runs, run_all(bare))
  ]


def run_all(runs: Sequence[BlockRun | None]) -> list[tuple[list[jax.Array], Any] | None]:
  """Each run's ``(outs, new_stacks)`` (``runs[i]`` None: nothing to run, its result None).

  ``stacks`` go in and come back stored (``(*grid, ...)``,
  :func:`~bv_sharding.optimizers.placement.stored_spec`). Runs whose blocks are
  :attr:`~bv_sharding.optimizers.tiles.ShardBlocks.pooled` and that share ``fn`` (the same
  object), the tile shape and the stacks' structure, shapes and dtypes form one pool on a
  concrete mesh (:func:`~bv_sharding.optimizers.pools.run_pool`): their block stacks (arrays
  and stacks) are concatenated, padded to a multiple of the device count and split over every
  mesh axis, and ``fn`` runs once on the pool (a run that :func:`turns` joins it on its
  param's transpose, and its results are turned back). A scalar every run of a pool passes as
  the same object stays a scalar; other scalars reach ``fn`` as one value per block (``(n,)``).
  A run's :attr:`~bv_sharding.optimizers.shard_run.BlockRun.squares` follow its outs (a pool's
  summed once for all its runs, :func:`~bv_sharding.optimizers.pools.run_pool`).
  Other runs of shard-local blocks that share the same run together, one call of ``fn`` per device
  (:func:`~bv_sharding.optimizers.shard_run.run_together`), relaid ones (tiles pooled in
  their param's layout, whole in another's:
  :attr:`~bv_sharding.optimizers.tiles.ShardBlocks.relaid_from`) with their arrays moved
  there and their outs back; the others run alone
  (:func:`~bv_sharding.optimizers.shard_run.run_alone`).

  Example:
      >>> double = lambda arrays, stacks: ([2 * arrays[0]], stacks)
      >>> blocks = Tiling(2).blocks((4, 4), (), None)
      >>> [((out,), _)] = run_all([BlockRun(blocks, double, [jnp.ones((4, 4))], ())])
      >>> float(out.sum())
      32.0
  """
  turned, runs = _oriented(runs)
  results: list = [None] * len(runs)
  pools = _pools(runs)
  local: dict[tuple, list[int]] = {}
  alone = []
  for i, run in enumerate(runs):
    if run is None or run.blocks.in_pool:
      continue
    if _shard_local(run.blocks):
      local.setdefault(pool_key(run) + (len(run.scalars),), []).append(i)
    else:
      alone.append(i)
  # Probes a pool, a group of shard-local runs or a param's owners draw in place stay probes;
  # every other one is drawn whole, in one go.
  in_place = lambda members: [
      (i, j) for j in drawn_in_place([runs[i] for i in members]) for i in members
  ]
  owned = [[i] for i in alone if runs[i].blocks.owners and runs[i].blocks.mesh is not None]
  groups = [*pools.values(), *local.values(), *owned]
  runs = drawn_whole(runs, {ij for members in groups for ij in in_place(members)})
  for i in alone:
    results[i] = run_alone(runs[i])
  pooled = run_pools([[runs[i] for i in members] for members in pools.values()])
  squares: dict[int, list] = {}  # A pooled run's sums of squares, after its outs.
  for members, (outs, new_stacks) in zip(pools.values(), pooled):
    for i, out, new in zip(members, outs, new_stacks):
      count = len(out) - len(runs[i].squares)
      results[i], squares[i] = (out[:count], new), out[count:]
  for members in local.values():
    for i, result in zip(members, run_together([runs[i] for i in members])):
      results[i] = result
  done = [
      _unturned(run, result) if t else _unrelaid(run, result)
      for run, result, t in zip(runs, results, turned)
  ]
  return [
      _with_squares(run, result, squares.get(i)) for i, (run, result) in enumerate(zip(runs, done))
  ]


class PoolPlan(NamedTuple):
  """A pool :func:`run_all` forms on a concrete mesh: its ``members`` (indices of its runs) in
  the order of its slots, each member's ``blocks`` as the pool runs them, and which of them
  are ``turned`` (:func:`turns`)."""

  members: list[int]
  blocks: list[ShardBlocks]
  turned: list[bool]

  @property
  def starts(self) -> list[int]:
    """Each member's first slot: its tiles take ``blocks.count`` slots from there."""
    return [0, *itertools.accumulate(b.count for b in self.blocks)][:-1]


def pools_of(runs: Sequence[BlockRun | None]) -> list[PoolPlan]:
  """The pools :func:`run_all` runs ``runs`` in, on a concrete mesh (on an ``AbstractMesh``,
  those it would on a concrete one of its shape), in its order: what an optimizer that keeps
  a pool's state where it runs (:attr:`~bv_sharding.optimizers.shard_run.BlockRun.resident`)
  sizes it by, and where each member's tiles sit in it.

  Example:
      >>> mesh = jax.sharding.AbstractMesh((1,), ("data",))
      >>> tall = Tiling(8).blocks((8, 4), ("data",), mesh)  # One 8 x 4 tile: turned
      >>> pooled = dataclasses.replace(tall, pooled=True)
      >>> run = lambda blocks: BlockRun(blocks, None, [jnp.ones(blocks.shape)], (), turnable=True)
      >>> [pool] = pools_of([run(pooled), None, run(pooled)])
      >>> pool.members, [b.shape for b in pool.blocks], pool.turned, pool.starts
      ([0, 2], [(4, 8), (4, 8)], [True, True], [0, 1])
  """
  turned, oriented = _oriented(runs, planned=True)
  plans = []
  for members in _pools(oriented, planned=True).values():
    like = like_groups([oriented[i] for i in members])
    order = [members[j] for group in like for j in group]
    plans.append(PoolPlan(order, [oriented[i].blocks for i in order], [turned[i] for i in order]))
  return plans


def _oriented(runs: Sequence[BlockRun | None], planned: bool = False) -> tuple[list, list]:
  """Which runs turn (:func:`turns`; ``planned``: also on an ``AbstractMesh``), and the runs as
  they run: turned, or relaid."""
  turned = [
      run is not None and run.turnable and (planned or run.blocks.in_pool) and turns(run.blocks)
      for run in runs
  ]
  return turned, [_turned(run) if t else _relaid(run) for run, t in zip(runs, turned)]


def _pools(runs: Sequence[BlockRun | None], planned: bool = False) -> dict[tuple, list[int]]:
  """The pooled runs' indices by :func:`~bv_sharding.optimizers.pools.pool_key` (``planned``:
  also on an ``AbstractMesh``)."""
  pools: dict[tuple, list[int]] = {}
  for i, run in enumerate(runs):
    if run is not None and (run.blocks.pooled if planned else run.blocks.in_pool):
      pools.setdefault(pool_key(run), []).append(i)
  return pools


def _with_squares(run: BlockRun | None, result, pooled: list | None):
  """``result`` with ``run``'s :attr:`~bv_sharding.optimizers.shard_run.BlockRun.squares` after
  its outs: the pool's (``pooled``), else each out's own float32 sum of squares."""
  if result is None:
    return None
  outs, stacks = result
  if pooled is None:
    pooled = [jnp.sum(jnp.square(outs[j].astype(jnp.float32))) for j in run.squares]
  return [*outs, *pooled], stacks


def turns(blocks: ShardBlocks) -> bool:
  """Whether a pooled param of 2-D tiles (a matrix, or a stack of layers' matrices) runs
  transposed (:attr:`BlockRun.turnable`): tiles taller than wide, or square ones of a param
  split on its columns alone. Turned, like tiles of both orientations join one pool (fewer
  pools, less padding), and a param split on its columns reaches it without first moving to
  its rows.

  Example:
      >>> mesh = jax.sharding.Mesh(jax.devices()[:1], ("data",))
      >>> pooled = lambda shape, spec, scanned=False: ShardBlocks(
      ...     shape, (1,) * len(shape), 4, scanned, spec=spec, mesh=mesh, pooled=True)
      >>> turns(pooled((6, 2), (None, None))), turns(pooled((2, 6), (None, None)))
      (True, False)
      >>> stack = pooled((2, 4, 4), (None, "data", None), scanned=True)  # Split on its rows.
      >>> turns(pooled((4, 4), (None, "data"))), turns(stack)
      (True, False)
  """
  if not blocks.pooled or len(blocks.sizes) != 2:
    return False
  rows, cols = blocks.sizes
  split = [bool(stack_axes((entry,))) for entry in blocks.spec[int(blocks.scanned) :]]
  return rows > cols or (rows == cols and split == [False, True])


def turned_blocks(blocks: ShardBlocks) -> ShardBlocks:
  """``blocks`` of the param's transpose (its last two dims swapped), as a turned run's.

  Example:
      >>> turned_blocks(Tiling(4).blocks((8, 4), (None, None), None)).shape
      (4, 8)
  """
  turn = lambda dims: (*dims[:-2], dims[-1], dims[-2])
  return dataclasses.replace(blocks, shape=turn(blocks.shape), spec=turn(blocks.spec))


def swapped(stacks, grid: int) -> list:
  """Per-dim factor stacks in grid form (``(*grid, ...)`` each, ``grid`` dims, the tile rows
  and columns last), for the transposed param: each entry's list reversed and its grid's last
  two dims swapped (its own inverse)."""
  return [[jnp.swapaxes(x, grid - 2, grid - 1) for x in reversed(entry)] for entry in stacks]


def _turned(run: BlockRun) -> BlockRun:
  """``run`` on its param's transpose (:func:`turns`; a stack of layers' matrices, each)."""
  return run._replace(
      blocks=turned_blocks(run.blocks),
      arrays=[
          x._replace(turned=True) if isinstance(x, TileNormal) else jnp.swapaxes(x, -1, -2)
          for x in run.arrays
      ],
      stacks=swapped(run.stacks, len(run.blocks.grid_shape)),
  )


def _unturned(run: BlockRun, result):
  """A turned ``run``'s ``result`` in its param's own orientation (a resident pool's state
  stays in the pool's)."""
  outs, new_stacks = result
  if run.resident is None:
    new_stacks = swapped(new_stacks, len(run.blocks.grid_shape))
  return [jnp.swapaxes(o, -1, -2) for o in outs], new_stacks


def _relaid(run: BlockRun | None) -> BlockRun | None:
  """``run`` with its arrays moved from the param's spec to the layout its blocks run in,
  where they are :attr:`~bv_sharding.optimizers.tiles.ShardBlocks.relaid_from` another (its
  probes are drawn there)."""
  if run is None or not run.blocks.relaid:
    return run
  blocks = run.blocks
  there = lambda x: moves.move(x, blocks.mesh, blocks.relaid_from, blocks.spec)
  return run._replace(arrays=[a if isinstance(a, TileNormal) else there(a) for a in run.arrays])


def _unrelaid(run: BlockRun | None, result):
  """A relaid run's ``result`` with its outs moved back to the param's spec."""
  if run is None or not run.blocks.relaid:
    return result
  outs, new_stacks = result
  back = lambda x: moves.move(x, run.blocks.mesh, run.blocks.spec, run.blocks.relaid_from)
  return [back(o) for o in outs], new_stacks


def _shard_local(blocks: ShardBlocks) -> bool:
  """Whether each device fits the blocks of its own shard (on a concrete mesh, neither dealt
  to owners nor a dealt param's pieces)."""
  return blocks.mesh is not None and blocks.owners is None and not blocks.dealt
