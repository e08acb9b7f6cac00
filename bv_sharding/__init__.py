"""bv_sharding: config-driven sharding plans for Flax params and any optax optimizer state.

Example:
  >>> import bv_sharding as bvs
  >>> mesh = bvs.make_mesh([("data", -1), ("model", 2)])
  >>> strategy = [(".*embedding", 'shard_dim(axis="model", dim=-1)'),
  ...             (".*", 'fsdp(axis="data", min_size_to_shard_mb=1)')]
  >>> abstract = jax.eval_shape(model.init, rng, batch)
  >>> shardings, specs = bvs.infer_sharding(abstract, strategy, mesh)
  >>> params = jax.jit(model.init, out_shardings=shardings)(rng, batch)
"""

from bv_sharding import strategies as _builtin_ops  # noqa: F401  (registers the built-in ops)
from bv_sharding.coverage import check_coverage
from bv_sharding.errors import Error, ShardingError
from bv_sharding.fingerprint import check_same_plan
from bv_sharding.mesh import make_abstract_mesh, make_mesh
from bv_sharding.names import flatten as flatten_with_names
from bv_sharding.plan import Entry, Plan, infer_sharding, plan
from bv_sharding.registry import lookup, parse_chain, register, registered

__all__ = [
    "Entry",
    "Error",
    "Plan",
    "ShardingError",
    "check_coverage",
    "check_same_plan",
    "flatten_with_names",
    "infer_sharding",
    "lookup",
    "make_abstract_mesh",
    "make_mesh",
    "parse_chain",
    "plan",
    "register",
    "registered",
]
