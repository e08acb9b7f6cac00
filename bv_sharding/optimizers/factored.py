"""Optax's Adafactor state placed by optax's own rule for which dims a statistic keeps.

``optax.adafactor`` (``optax.scale_by_factored_rms``) keeps, for a param it factors, a row
statistic ``v_row`` (the param less its largest dim) and a column statistic ``v_col`` (the
param less its second largest), and for any other param ``v``, the param's shape. Which dims
those are is optax's ``_factored_dims``: the two largest, by ``np.argsort`` of the shape.
Following by shapes alone cannot tell a square kernel's row statistic from its column one
(both ``(n,)`` for ``(n, n)``); the state type can. :class:`optax.FactoredState` is registered
with :func:`bv_sharding.ops.register_state` (``per_param="leaves"``): each statistic carries
its param's spec on the dims it keeps. That is also the sharding optax's update gives it under
Explicit axes (a mean over the dropped dim), so ``jax.jit(tx.update)`` keeps the plan's
shardings. A statistic that keeps none of its param's axes (under 1-D FSDP, the one keeping
the param's unsharded dim) is left to following: on Auto axes the plan's fallback splits its
own largest dim, on Explicit axes it stays as the update leaves it, unsharded (the plan's
specs then depend on the mesh's axis types: :mod:`bv_sharding.planning`). So is ``v`` of a
param not factored: the param's shape, followed as Adam's moments are.

Example:
  >>> import jax, optax
  >>> import bv_sharding as bvs
  >>> params = {"q": jax.ShapeDtypeStruct((256, 256), "float32")}
  >>> tree = {"params": params, "opt": jax.eval_shape(optax.adafactor(1e-3).init, params)}
  >>> mesh = bvs.make_abstract_mesh([("data", 4), ("model", 2)], 8)
  >>> strategy = 'shard_dim(axis="model", dim=-1)|fsdp(axis="data", min_size_to_shard_mb=0)'
  >>> p = bvs.plan(tree, strategy, mesh).by_name()
  >>> p["params/q"].spec, p["opt/0/v_row/q"].spec, p["opt/0/v_col/q"].spec
  (P('data', 'model'), P('data',), P('model',))
  >>> p = bvs.plan(tree, 'fsdp(axis="data", min_size_to_shard_mb=0)', mesh).by_name()
  >>> p["params/q"].spec, p["opt/0/v_row/q"].spec, p["opt/0/v_col/q"].spec  # Auto axes
  (P(None, 'data'), P('data',), P('data',))
  >>> explicit = bvs.make_abstract_mesh([("data", 4), ("model", 2)], 8, axis_types="explicit")
  >>> bvs.plan(tree, 'fsdp(axis="data", min_size_to_shard_mb=0)', explicit).by_name()[
  ...     "opt/0/v_row/q"].spec
  P(None,)
"""

import jax
import numpy as np
import optax

from bv_sharding import ops
from bv_sharding.declared import ParamOf
from bv_sharding.specs import Spec


def factored_dims(shape) -> tuple[int, int] | None:
  """optax's ``_factored_dims`` of a factored param: ``(second largest dim, largest dim)``.

  ``v_row`` drops the largest, ``v_col`` the second largest; ties go by ``np.argsort``.

  Example:
    >>> factored_dims((512, 128)), factored_dims((64, 64)), factored_dims((8,))
    ((1, 0), (0, 1), None)
  """
  if len(shape) < 2:
    return None
  order = np.argsort(shape)
  return int(order[-2]), int(order[-1])


def statistic_spec(field: str, shape, v_shape, param: ParamOf | None) -> Spec | None:
  """The spec of one leaf of ``field`` (``"v_row"``, ``"v_col"`` or ``"v"``) of ``shape``, its
  param's ``v`` of ``v_shape`` telling whether the param is factored (``v`` is then ``(1,)``);
  ``None`` where following places the leaf as any other: the ``v`` of a param not factored
  (the param's shape), a statistic that keeps none of its param's axes.

  Example:
    >>> q = ParamOf("q", (64, 64), ("data", "model"))
    >>> [statistic_spec(f, (64,), (1,), q) for f in ("v_row", "v_col")]
    [('data',), ('model',)]
    >>> statistic_spec("v_row", (1,), (64, 64), q)  # not factored: a placeholder
    (None,)
    >>> statistic_spec("v_col", (64,), (1,), ParamOf("w", (64, 64), ("data", None))) is None
    True
  """
  replicated = (None,) * len(shape)
  if param is None:
    return replicated
  factored = tuple(v_shape) != tuple(param.shape)
  if field == "v":
    return replicated if factored else None
  dims = factored_dims(param.shape) if factored else None
  if dims is None:
    return replicated
  dropped = dims[1] if field == "v_row" else dims[0]
  spec = tuple(param.spec) + (None,) * (len(param.shape) - len(param.spec))
  kept = tuple(n for d, n in enumerate(param.shape) if d != dropped)
  if kept != tuple(shape):
    return replicated
  carried = tuple(entry for d, entry in enumerate(spec) if d != dropped)
  return carried if any(carried) else None


def factored_specs(node: optax.FactoredState, params, mesh_sizes) -> list[Spec | None]:
  """Every leaf's spec of ``node`` (``params``: the node's :class:`ParamOf` per leaf, or None);
  ``None`` where following places the leaf (:func:`statistic_spec`).

  Example:
    >>> state = optax.FactoredState(jax.numpy.zeros([]), {"q": jax.numpy.zeros(4)},
    ...                             {"q": jax.numpy.zeros(8)}, {"q": jax.numpy.zeros(1)})
    >>> q = ParamOf("q", (8, 4), (None, "data"))
    >>> factored_specs(state, optax.FactoredState(None, {"q": q}, {"q": q}, {"q": q}), {})
    [(), ('data',), None, (None,)]
  """
  del mesh_sizes
  leaves = lambda tree: jax.tree.leaves(tree, is_leaf=lambda x: x is None or _is_param(x))
  v_shapes = [np.shape(v) for v in jax.tree.leaves(node.v)]
  specs = [(None,) * np.ndim(node.count)]
  for field in ("v_row", "v_col", "v"):
    stats, owners = jax.tree.leaves(getattr(node, field)), leaves(getattr(params, field))
    specs += [statistic_spec(field, np.shape(x), v, p) for x, v, p in zip(stats, v_shapes, owners)]
  return specs


def _is_param(x) -> bool:
  return isinstance(x, ParamOf)


ops.register_state(optax.FactoredState, factored_specs, per_param="leaves")
