"""big_vision's ``sharding`` module as its ``train.py`` calls it: ``infer_sharding``.

The strategy's ops are the library's (``fsdp``, ``shard_dim``, ``replicate``,
``logical_partitioning``, ... with big_vision's arguments), so big_vision's
``config.sharding_strategy`` works unchanged; ``logical_partitioning`` reads the rules of
the enclosing ``nn.logical_axis_rules``, as big_vision's ``train.py`` sets them.

Example:
  >>> import jax
  >>> from bv_sharding.mesh import make_abstract_mesh
  >>> state = {"params": {"w": jax.ShapeDtypeStruct((1024, 4096), "float32")}}
  >>> mesh = make_abstract_mesh([("data", -1)], 8)
  >>> infer_sharding(state, strategy=[(".*", 'fsdp(axis="data")')], mesh=mesh)["params"]["w"].spec
  P(None, 'data')
"""

from bv_sharding.planning import plan

__all__ = ["infer_sharding"]


def infer_sharding(params, strategy, mesh):
  """The ``NamedSharding`` tree of ``params`` (boxes unboxed) for ``strategy`` on ``mesh``.

  big_vision's signature and return. ``params`` is any tree of arrays, shapes or flax
  boxes; with a top-level ``params`` key (big_vision's ``{"params": ..., "opt": ...}``)
  the other leaves follow their params (:func:`bv_sharding.plan`, which also says why
  each leaf is placed as it is).
  """
  return plan(params, strategy, mesh).shardings
