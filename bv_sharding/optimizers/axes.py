"""Optimizer updates on meshes with Explicit axes: the same update as on Auto axes.

Under Explicit axes ("sharding in types") an op whose operands are sharded differently
raises ``ShardingTypeError`` instead of letting XLA move data. Optimizer updates mix
leaves the plan shards independently: Adafactor's row and column statistics against
the gradient they factor, Kron's random probe (replicated) against the param's shard
in ``shard_map``, Muon's matrices of one shape but different specs concatenated into
one stack. :func:`auto_axes_update` runs such an update with the mesh's Explicit axes
switched to Auto (``jax.sharding.auto_axes``) and types its results back with the
shardings the gradients and the state came in: XLA partitions the update exactly as on
an Auto mesh (same math, same collectives), and the step around it stays typed. On an
Auto mesh the update is the optimizer's own, untouched.

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
from jax.sharding import AxisType


def explicit_shardings(tree) -> Any | None:
  """The typed shardings of ``tree``'s arrays when any lies on a mesh with Explicit axes.

  None on Auto (or no) meshes: nothing to restore there.

  Example:
      >>> explicit_shardings({"w": jax.numpy.ones(3)}) is None  # no mesh: no types
      True
  """
  shardings = jax.tree.map(lambda x: jax.typeof(x).sharding, tree)
  meshes = [s.mesh for s in jax.tree.leaves(shardings)]
  if any(AxisType.Explicit in m.axis_types for m in meshes):
    return shardings
  return None


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
  """``tx`` whose update runs in Auto axes on an Explicit mesh (module docstring).

  The updates come back in the gradients' shardings and the state in its own: the
  shardings the plan gives them.
  """

  def update_fn(updates, state, params=None, **extra_args):
    update = lambda u, s, p: optax.with_extra_args_support(tx).update(u, s, p, **extra_args)
    shardings = explicit_shardings((updates, state))
    if shardings is None:
      return update(updates, state, params)
    return jax.sharding.auto_axes(update, out_sharding=shardings)(updates, state, params)

  return optax.GradientTransformationExtraArgs(tx.init, update_fn)
