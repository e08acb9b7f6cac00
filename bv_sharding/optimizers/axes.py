"""Optimizer updates on meshes with Explicit axes: the same update as on Auto axes.

Under Explicit axes ("sharding in types") an op whose operands are sharded differently,
or whose output sharding they do not decide, raises ``ShardingTypeError`` instead of
letting XLA move data. Some optimizer updates are made of such ops whatever the state's
placement: inner products of the whole tree (``optax.lbfgs``, ``optax.contrib.prodigy``),
products and ``svd`` of a sharded matrix (``optax.contrib.muon``, ``galore``), Kron's
random probe (replicated) against the param's shard in ``shard_map``, Muon's matrices of
one shape but different specs concatenated into one stack. :func:`auto_axes_update` runs
such an update with the mesh's Explicit axes switched to Auto (``jax.sharding.auto_axes``)
and types its results back with the shardings the gradients and the state came in: XLA
partitions the update exactly as on an Auto mesh (same math, same collectives), and the
step around it stays typed. On an Auto mesh the update is the optimizer's own, untouched.
Elementwise optimizers (Adam, Adafactor, SM3, ...) need no wrapper: the plan places their
state so that their own math is legal (:mod:`bv_sharding.following`).

Example:
    >>> import jax.numpy as jnp
    >>> tx = auto_axes_update(optax.adafactor(1e-2))
    >>> params = {"w": jnp.ones((4, 8))}
    >>> updates, state = tx.update(params, tx.init(params), params)
    >>> updates["w"].shape
    (4, 8)
"""

from __future__ import annotations

from typing import Any

import jax
import optax
from jax.sharding import AxisType, NamedSharding, PartitionSpec


def explicit_shardings(tree) -> Any | None:
  """The typed shardings of ``tree``'s arrays when any lies on a mesh with Explicit axes.

  None on Auto (or no) meshes: nothing to restore there. An array on no mesh (a step
  count ``tx.init`` made outside ``jit``) is given the Explicit mesh, replicated: every
  sharding of one ``auto_axes`` call names the same mesh.

  Example:
      >>> explicit_shardings({"w": jax.numpy.ones(3)}) is None  # no mesh: no types
      True
      >>> mesh = jax.make_mesh((8,), ("data",))
      >>> w = jax.device_put(jax.numpy.ones(8), jax.NamedSharding(mesh, jax.P("data")))
      >>> [s.spec for s in explicit_shardings([w, jax.numpy.zeros([])])]
      [P('data',), P()]
  """
  shardings = jax.tree.map(lambda x: jax.typeof(x).sharding, tree)
  meshes = [s.mesh for s in jax.tree.leaves(shardings)]
  explicit = [m for m in meshes if AxisType.Explicit in m.axis_types]
  if not explicit:
    return None
  on_mesh = lambda s: s if s.mesh.axis_names else NamedSharding(explicit[0], PartitionSpec())
  return jax.tree.map(on_mesh, shardings)


def auto_mesh(mesh):
  """``mesh`` with every axis Auto: the mesh an update in :func:`auto_axes_update` runs on.

  ``shard_map`` and sharding constraints inside the update name this mesh (the context
  mesh there has no Explicit axes). None stays None.

  Example:
      >>> mesh = jax.sharding.AbstractMesh((2,), ("data",), axis_types=(AxisType.Explicit,))
      >>> auto_mesh(mesh).axis_types
      (Auto,)
  """
  if mesh is None:
    return None
  return mesh.update(axis_types=(AxisType.Auto,) * len(mesh.axis_names))


def auto_axes_update(tx: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
  """``tx`` whose update runs with the mesh's Explicit axes switched to Auto.

  Under Explicit axes ("sharding in types", the axes ``jax.make_mesh`` gives by default)
  an op whose output sharding its operands do not decide raises ``ShardingTypeError``
  where XLA would otherwise move data. Some optimizers' updates contain such ops whatever
  the state's placement: an inner product of the whole tree (``optax.lbfgs``,
  ``optax.contrib.prodigy``, ``dadapt_adamw``), products or decompositions of a sharded
  matrix (``optax.contrib.muon``, ``galore``), the project's Kron, Shampoo and Muon.
  Wrapped, the update runs in ``jax.sharding.auto_axes`` and XLA partitions it exactly as
  on an Auto mesh (same values, same collectives); the updates come back typed with the
  gradients' shardings and the state with its own (the plan's, when they came in as
  planned), so the step around it stays typed. On an Auto mesh, or with no mesh, the
  update is ``tx``'s own, untouched. ``init`` is ``tx``'s.

  Example:
      >>> mesh = jax.make_mesh((8,), ("data",))  # Explicit axes
      >>> w = jax.device_put(jax.numpy.ones((16, 8)), jax.NamedSharding(mesh, jax.P("data")))
      >>> tx = auto_axes_update(optax.contrib.muon(1e-2))  # plain: ShardingTypeError
      >>> updates, state = jax.jit(tx.update)(w, tx.init(w), w)
      >>> jax.typeof(updates).sharding.spec
      P('data', None)
  """

  def update_fn(updates, state, params=None, **extra_args):
    update = lambda u, s, p: optax.with_extra_args_support(tx).update(u, s, p, **extra_args)
    shardings = explicit_shardings((updates, state))
    if shardings is None:
      return update(updates, state, params)
    return jax.sharding.auto_axes(update, out_sharding=shardings)(updates, state, params)

  return optax.GradientTransformationExtraArgs(tx.init, update_fn)
