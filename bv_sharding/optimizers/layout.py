"""The params' layout: their specs and mesh, as the optimizers cut and run their blocks on it.

Kron and Shampoo precondition blocks of a param, Muon whole matrices. Given the plan's param
specs and the mesh through :class:`ParamLayout`, they compute each block where its data is:
:mod:`bv_sharding.optimizers.tiles` (how a param's blocks lie in its shards),
:mod:`bv_sharding.optimizers.shard_run` (one param's blocks in ``shard_map``),
:mod:`bv_sharding.optimizers.pools` (tiles that span shards, pooled and dealt over the mesh),
:mod:`bv_sharding.optimizers.placement` (where their block stacks are stored) and
:mod:`bv_sharding.optimizers.blocked` (every param's blocks in one step).

Example:
    >>> mesh = jax.sharding.AbstractMesh((2,), ("data",))
    >>> w = jax.ShapeDtypeStruct((8, 6), "float32")
    >>> ParamLayout({"w": P("data")}, mesh).blocks_of({"w": w}, 2)["w"].shards
    (2, 1)
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from bv_sharding.optimizers.axes import auto_mesh
from bv_sharding.optimizers.tiles import shard_blocks


@dataclasses.dataclass(frozen=True)
class ParamLayout:
  """How params are sharded: ``specs`` (a ``PartitionSpec`` per param leaf) on ``mesh``.

  ``mesh`` is a ``jax.sharding.Mesh`` (the optimizer runs its blocks in
  ``shard_map``) or an ``AbstractMesh`` (same blocks, computed on global arrays).
  ``stacked``: a bool per param leaf (a tree like ``specs``), True where the leaf's dim 0 is a
  stack of layers (``flax.linen.scan``'s params; :func:`layer_stacks` reads them from flax's
  logical names), or None: none is. Kron (unless given ``scanned_layers`` itself), Shampoo
  and SOAP then precondition each layer of such a leaf as its own matrix, as they do the same
  layers unscanned.
  A training loop builds it from the plan of the params with :meth:`from_plan`. The mesh
  is kept with Auto axes (:func:`~bv_sharding.optimizers.axes.auto_mesh`): the registry's
  updates run in Auto axes on any mesh (``axes.py``).

  Example:
      >>> mesh = jax.sharding.AbstractMesh((4,), ("data",))
      >>> layout = ParamLayout({"w": P("data", None)}, mesh)
      >>> layout.blocks_of({"w": jax.ShapeDtypeStruct((8, 6), "float32")}, 2)["w"].count
      12
  """

  specs: Any
  mesh: Any
  stacked: Any = None

  def __post_init__(self):
    object.__setattr__(self, "mesh", auto_mesh(self.mesh))

  @classmethod
  def from_plan(cls, plan, stacked=None) -> ParamLayout:
    """The layout of a ``bvs.Plan`` made over ``{"params": abstract_params}``; ``stacked``: the
    leaves that are stacks of layers (see the class), or None."""
    return cls(plan.specs["params"], plan.mesh, stacked)

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


def layer_stacks(params, axis: str = "layers") -> Any:
  """A bool per leaf of ``params`` (flax boxes, as a model's ``init`` returns them): whether
  its first logical axis is ``axis``, the layer axis ``nn.scan(...,
  metadata_params={nn.PARTITION_NAME: axis})`` adds; for ``ParamLayout.from_plan(plan,
  layer_stacks(params))``.

  Example:
      >>> import flax.linen as nn, jax.numpy as jnp
      >>> w = nn.LogicallyPartitioned(jnp.zeros((3, 2, 2)), ("layers", "embed", "mlp"))
      >>> layer_stacks({"w": w, "b": jnp.zeros(2)})
      {'b': False, 'w': True}
  """
  boxed = lambda x: isinstance(x, nn.Partitioned)
  return jax.tree.map(lambda x: boxed(x) and x.names[:1] == (axis,), params, is_leaf=boxed)


def stacked_leaves(layout: ParamLayout | None, params) -> list[bool]:
  """Per leaf of ``params`` (flattened), whether ``layout`` marks it a stack of layers
  (:attr:`ParamLayout.stacked`); none is without a layout or its ``stacked``.

  Example:
      >>> mesh = jax.sharding.AbstractMesh((2,), ("data",))
      >>> layout = ParamLayout({"a": P(), "b": P()}, mesh, stacked={"a": True, "b": False})
      >>> stacked_leaves(layout, {"a": 0, "b": 0}), stacked_leaves(None, {"a": 0, "b": 0})
      ([True, False], [False, False])
  """
  treedef = jax.tree.structure(params)
  if layout is None or layout.stacked is None:
    return [False] * treedef.num_leaves
  return treedef.flatten_up_to(layout.stacked)


def param_placers(layout: ParamLayout | None, treedef) -> list:
  """Per param leaf of ``treedef``, a function that keeps a param-shaped array in that param's
  sharding (identity without a layout): an update or a param-shaped state leaf that comes back
  from a block run wherever the run left it (with shard-local blocks a replicated param's
  update came back sharded).

  Example:
      >>> mesh = jax.sharding.AbstractMesh((2,), ("data",))
      >>> [place] = param_placers(ParamLayout({"w": P("data")}, mesh), jax.tree.structure({"w": 0}))
      >>> place.keywords["shardings"].spec
      P('data',)
  """
  if layout is None:
    return [lambda x: x] * treedef.num_leaves
  return [
      functools.partial(
          jax.lax.with_sharding_constraint, shardings=NamedSharding(layout.mesh, P(*spec))
      )
      for spec in treedef.flatten_up_to(layout.specs)
  ]
