"""Where Kron's and Shampoo's block stacks are kept: a state node that declares it to the plan.

A blocked param's stacks (Kron's Qs, Shampoo's statistics and roots) are held in a
:class:`Stacks` node: a tuple of the stacks, each ``(*grid, ...)`` with the param's block
grid first (:attr:`~bv_sharding.optimizers.tiles.ShardBlocks.grid_shape`), and the
:class:`Tiling` that cut the param (block size, scanned, dealt, blocking). The state is
then a function of the params and the optimizer's settings alone, never of the mesh.
:class:`Stacks` is registered with :func:`bv_sharding.ops.register_state`: ``bvs.plan``
places each stack where the optimizer runs it (:func:`stored_spec` of the param's blocks on
the plan's mesh), from the state's tree alone (``jax.eval_shape(tx.init, params)``), and the
optimizer's run keeps it there (:func:`stored`).

Its leaves are named by index, like a list's (``Qs_preconditioners/w/0``), and it is a
tuple, so tools that walk lists and tuples (big_vision's ``tree_flatten_with_names``)
name them the same.

Example:
  >>> import jax, jax.numpy as jnp
  >>> import bv_sharding as bvs
  >>> from bv_sharding.optimizers import ParamLayout, scale_by_kron
  >>> mesh = bvs.make_abstract_mesh([("data", 4)], 4)
  >>> params = {"w": jax.ShapeDtypeStruct((512, 256), jnp.float32)}
  >>> strategy = 'fsdp(axis="data", min_size_to_shard_mb=0)'
  >>> layout = ParamLayout.from_plan(bvs.plan({"params": params}, strategy, mesh))
  >>> tx = scale_by_kron(block_size=128, layout=layout)
  >>> state = jax.eval_shape(tx.init, params)
  >>> [q.shape for q in state["Qs_preconditioners"]["w"]]  # a 4 x 2 grid of 128-tiles, packed
  [(4, 2, 65, 128), (4, 2, 65, 128)]
  >>> plan = bvs.plan({"params": params, "opt": state}, strategy, mesh)
  >>> plan.by_name()["opt/Qs_preconditioners/w/0"].spec  # each device its own rows' tiles
  P('data', None, None, None)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from bv_sharding import ops
from bv_sharding.errors import OptimizerError
from bv_sharding.following import find_param
from bv_sharding.names import leaf_name
from bv_sharding.ops import stack_axes
from bv_sharding.optimizers.tiles import (
    ShardBlocks,
    same_blocking,
    shard_blocks,
    spec_entry,
    tiles_text,
)

# A never-sharded param's block stack of at least this many elements is stored spread over
# the mesh (:func:`stored_spec`): 1 MiB in float32, a quarter of big_vision's fsdp threshold,
# so that a packed stack (half a whole one's size) beside a param at that threshold is spread
# too. Counted in elements, not bytes, so the plan and the optimizer agree whatever the state
# dtype.
SPREAD_MIN_ELEMENTS = 2**18


@dataclasses.dataclass(frozen=True)
class Tiling:
  """How an optimizer cuts a param into blocks (see
  :func:`~bv_sharding.optimizers.tiles.shard_blocks`): ``block_size``, ``scanned`` (dim 0 a
  layer axis), ``deal`` (a never-sharded param dealt over the devices), ``blocking``
  (``"tiles"`` or ``"local"``) and ``unit_dims_dropped`` (Shampoo: the param's unit dims
  are dropped before blocking).

  ``block_size`` None is one tile per param (per layer when scanned): unblocked Kron's, whose
  stacks are stored without their grid of ones, in psgd-jax's shapes (``(b_0, b_0)``, or
  ``(layers, b_0, b_0)`` scanned: :meth:`stored_form`), and run as any tile's.

  Example:
      >>> mesh = jax.sharding.AbstractMesh((2,), ("data",))
      >>> Tiling(4, unit_dims_dropped=True).blocks((8, 1, 6), ("data",), mesh).grid_shape
      (2, 2)
      >>> Tiling(None).blocks((8, 6), ("data",), mesh).grid_shape  # one 8 x 6 tile
      (1, 1)
  """

  block_size: int | None
  scanned: bool = False
  deal: bool = False
  blocking: str = "tiles"
  unit_dims_dropped: bool = False

  def blocks(self, shape, spec, mesh) -> ShardBlocks:
    """The :class:`~bv_sharding.optimizers.tiles.ShardBlocks` of a param of ``shape``
    sharded as ``spec`` on ``mesh`` (a ``Mesh``, an ``AbstractMesh`` or None)."""
    shape = tuple(shape)
    spec = tuple(spec) + (None,) * (len(shape) - len(tuple(spec)))
    if self.unit_dims_dropped:
      spec = tuple(e for d, e in zip(shape, spec) if d > 1)
      shape = tuple(d for d in shape if d > 1)
    size = self.block_size or max(shape[int(self.scanned) :], default=1)
    return shard_blocks(shape, spec, mesh, size, self.scanned, self.deal, blocking=self.blocking)

  def kept_grid(self, blocks: ShardBlocks) -> int:
    """How many of ``blocks``' grid dims a stored stack keeps: all of them, or, one tile per
    param, the scanned layer axis alone."""
    return int(self.scanned) if self.block_size is None else len(blocks.grid_shape)

  def stored_form(self, stack, blocks: ShardBlocks):
    """A ``(*grid, ...)`` stack of ``blocks`` as the state stores it (see :meth:`kept_grid`).

    Example:
        >>> blocks = Tiling(None).blocks((8, 6), (), None)
        >>> Tiling(None).stored_form(np.zeros((1, 1, 8, 8)), blocks).shape
        (8, 8)
    """
    grid = len(blocks.grid_shape)
    return stack.reshape(*stack.shape[: self.kept_grid(blocks)], *stack.shape[grid:])

  def grid_form(self, stack, blocks: ShardBlocks):
    """A stored stack of ``blocks`` as ``(*grid, ...)`` (undoes :meth:`stored_form`).

    Example:
        >>> blocks = Tiling(None).blocks((8, 6), (), None)
        >>> Tiling(None).grid_form(np.zeros((8, 8)), blocks).shape
        (1, 1, 8, 8)
    """
    return stack.reshape(*blocks.grid_shape, *stack.shape[self.kept_grid(blocks) :])


class Stacks(tuple):
  """One param's block stacks in an optimizer state, and the :attr:`tiling` that cut them.

  A pytree node (children: the stacks, keyed by index; static: the tiling) whose placement
  is declared to the plan (module docstring).

  Example:
      >>> import jax.numpy as jnp
      >>> s = Stacks([jnp.zeros((2, 3, 4, 4))], Tiling(4))
      >>> len(s), s.tiling.block_size, jax.tree.map(lambda x: x.shape, s).tiling == s.tiling
      (1, 4, True)
  """

  tiling: Tiling

  def __new__(cls, stacks: Iterable, tiling: Tiling):
    node = super().__new__(cls, stacks)
    node.tiling = tiling
    return node

  def __repr__(self) -> str:
    return f"Stacks({list(self)!r}, {self.tiling!r})"


jax.tree_util.register_pytree_with_keys(
    Stacks,
    lambda s: ([(jax.tree_util.SequenceKey(i), x) for i, x in enumerate(s)], s.tiling),
    lambda tiling, children: Stacks(children, tiling),
    lambda s: (tuple(s), s.tiling),
)


def stored_spec(blocks: ShardBlocks, shape, sizes: dict[str, int]) -> P:
  """Where a block stack of ``shape`` (``(*grid, ...)``) of ``blocks`` is stored on a mesh of
  ``sizes``.

  Shard-local blocks (:attr:`~bv_sharding.optimizers.tiles.ShardBlocks.shard_local`): the
  param's spec (or its dealt piece's) on the grid dims, so each device stores the factors of
  its own blocks. A never-sharded param's blocks are computed whole on every device; a stack
  of theirs that reaches :data:`SPREAD_MIN_ELEMENTS` is stored spread over every mesh axis, at
  the ideal, and gathered for the step (no big state stranded beside a param big_vision's
  ``fsdp`` leaves whole), smaller ones stay whole like their param (a ``replicate()`` strategy
  keeps small models' state replicated, as data parallelism does). Tiles dealt to owners
  (:attr:`~bv_sharding.optimizers.tiles.ShardBlocks.owners`) or pooled over the mesh
  (:attr:`~bv_sharding.optimizers.tiles.ShardBlocks.pooled`): the grid whole, the param's
  axes (a pool's: every mesh axis) spread over the blocks' own dims, at the ideal; each step
  an all-to-all moves them to where they are fitted, and back.

  Example:
      >>> mesh = jax.sharding.AbstractMesh((4,), ("data",))
      >>> local = shard_blocks((8, 6), P("data"), mesh, 2)
      >>> stored_spec(local, (4, 3, 2, 2), {"data": 4})
      P('data', None, None, None)
      >>> owned = shard_blocks((8, 6), P("data"), mesh, 4)  # 4-row tiles over 2-row shards
      >>> owned.owners, stored_spec(owned, (2, 2, 4, 4), {"data": 4})
      ((0, 'data', 2), P(None, None, 'data', None))
  """
  grid = len(blocks.grid_shape)
  if blocks.shard_local and not stack_axes(blocks.spec):  # A never-sharded param's.
    big = math.prod(shape) >= SPREAD_MIN_ELEMENTS
    return P(*spread(tuple(shape), stack_axes((), sizes) if big else (), sizes))
  if blocks.shard_local:
    return P(*blocks.spec, *(None,) * (len(shape) - grid))
  axes = stack_axes((), sizes) if blocks.pooled else stack_axes(blocks.spec)
  return P(*(None,) * grid, *spread(tuple(shape)[grid:], axes, sizes))


def stored(blocks: ShardBlocks, stacks):
  """``stacks`` (stored form) constrained to :func:`stored_spec` on ``blocks``' run mesh."""
  if blocks.mesh is None:
    return stacks
  sizes = dict(blocks.mesh.shape)
  place = lambda x: jax.lax.with_sharding_constraint(
      x, NamedSharding(blocks.mesh, stored_spec(blocks, x.shape, sizes))
  )
  return jax.tree.map(place, stacks)


def spread(shape, axes, sizes: dict[str, int]) -> tuple:
  """``axes`` together on the first dim of ``shape`` they divide (one all-to-all from the
  pool's dim 0), else each on the first dim it divides (with those already there).

  Example:
      >>> spread((3, 8), ("data", "model"), {"data": 4, "model": 2})
      (None, ('data', 'model'))
      >>> spread((4, 6), ("data", "model"), {"data": 4, "model": 2})
      ('data', 'model')
  """
  together = next(
      (d for d, n in enumerate(shape) if n % math.prod(sizes[a] for a in axes) == 0), None
  )
  if together is not None:
    return tuple(spec_entry(axes if d == together else ()) for d in range(len(shape)))
  placed = [[] for _ in shape]
  for axis in axes:
    for dim, extent in enumerate(shape):
      if extent % (math.prod(sizes[a] for a in placed[dim]) * sizes[axis]) == 0:
        placed[dim].append(axis)
        break
  return tuple(spec_entry(p) for p in placed)


def _placed(node: Stacks, param_shape, param_spec, mesh_sizes: dict[str, int]) -> list:
  """Each stack's :func:`stored_spec`, on its stored form (:meth:`Tiling.kept_grid`)."""
  blocks = node.tiling.blocks(param_shape, param_spec, _abstract_mesh(mesh_sizes))
  kept, grid = node.tiling.kept_grid(blocks), len(blocks.grid_shape)

  def placed(x):
    shape = (*blocks.grid_shape, *np.shape(x)[kept:])
    entries = tuple(stored_spec(blocks, shape, mesh_sizes))
    entries += (None,) * (len(shape) - len(entries))
    return P(*entries[:kept], *entries[grid:])

  return [placed(x) for x in node]


ops.register_state(Stacks, _placed)


def _abstract_mesh(sizes: dict[str, int]):
  return jax.sharding.AbstractMesh(tuple(sizes.values()), tuple(sizes))


def state_blocks(state, params, layout) -> list[tuple[str, ShardBlocks]]:
  """``(name, blocks)`` of every :class:`Stacks` node of ``state``: the param's blocks under
  ``layout`` (a :class:`~bv_sharding.optimizers.ParamLayout`), named as in a plan of
  ``{"params", "opt"}``.

  Example:
      >>> import jax.numpy as jnp
      >>> from bv_sharding.optimizers import ParamLayout, scale_by_shampoo
      >>> from jax.sharding import PartitionSpec as P
      >>> params = {"w": jax.ShapeDtypeStruct((8, 4), jnp.float32)}
      >>> layout = ParamLayout({"w": P("data")}, jax.sharding.AbstractMesh((2,), ("data",)))
      >>> state = jax.eval_shape(scale_by_shampoo(block_size=4, layout=layout).init, params)
      >>> [(name, b.grid_shape) for name, b in state_blocks(state, params, layout)]
      [('opt/per_param/w/stats', (2, 1)), ('opt/per_param/w/roots', (2, 1))]
  """
  named = jax.tree_util.tree_flatten_with_path(params)[0]
  by_path = {tuple(leaf_name(p).split("/")): i for i, (p, _) in enumerate(named)}
  specs = jax.tree.structure(params).flatten_up_to(layout.specs)
  found = []
  nodes = jax.tree_util.tree_flatten_with_path(state, is_leaf=lambda x: isinstance(x, Stacks))[0]
  for path, node in nodes:
    if not isinstance(node, Stacks):
      continue
    name = f"opt/{leaf_name(path)}"
    index, _ = find_param(tuple(name.split("/")), by_path)
    if index is not None:
      found.append((name, node.tiling.blocks(named[index][1].shape, specs[index], layout.mesh)))
  return found


def check_same_tiles(state, params, saved_layout, layout) -> None:
  """Raises ``OptimizerError`` naming the first stack of ``state`` whose blocks under
  ``saved_layout`` are not the same tiles as under ``layout`` (``blocking="local"`` on
  another mesh): its factors would precondition other blocks.

  Example:
      >>> import jax.numpy as jnp
      >>> from bv_sharding.optimizers import ParamLayout, scale_by_shampoo
      >>> from jax.sharding import PartitionSpec as P
      >>> params = {"w": jax.ShapeDtypeStruct((8, 4), jnp.float32)}
      >>> on = lambda n: ParamLayout({"w": P("data")}, jax.sharding.AbstractMesh((n,), ("data",)))
      >>> tx = scale_by_shampoo(block_size=4, blocking="local", layout=on(2))
      >>> check_same_tiles(jax.eval_shape(tx.init, params), params, on(2), on(4))
      Traceback (most recent call last):
      ...
      bv_sharding.errors.OptimizerError: opt/per_param/w/stats: (4, 4) blocks of a (8, 4) param in (2, 1) shards before, (2, 4) blocks of a (8, 4) param in (4, 1) shards now
  """
  for (name, old), (_, new) in zip(
      state_blocks(state, params, saved_layout), state_blocks(state, params, layout), strict=True
  ):
    if not same_blocking(old, new):
      raise OptimizerError(f"{name}: {tiles_text(old)} before, {tiles_text(new)} now")
