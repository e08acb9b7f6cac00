"""Config-driven sharding plans for Flax params and any optax optimizer state.

Example:
  >>> import flax.linen as nn
  >>> import jax
  >>> import bv_sharding as bvs
  >>> mesh = bvs.make_mesh([("data", -1), ("model", 2)])  # 8 devices: data 4 x model 2
  >>> strategy = [(".*kernel", 'shard_dim(axis="model", dim=-1)|fsdp(axis="data", min_size_to_shard_mb=1)'),
  ...             (".*", "replicate()")]
  >>> model, x = nn.Dense(1024), jax.numpy.ones((2, 512))
  >>> abstract = jax.eval_shape(model.init, jax.random.key(0), x)  # nothing allocated
  >>> shardings, specs = bvs.infer_sharding(abstract, strategy, mesh)
  >>> specs["params"]["kernel"], specs["params"]["bias"]
  (P('data', 'model'), P(None,))
  >>> params = jax.jit(model.init, out_shardings=shardings)(jax.random.key(0), x)
  >>> params["params"]["kernel"].sharding.spec
  P('data', 'model')

The names below are the whole API; the modules behind them are internal. Extending the
library (an op of your own, an optimizer whose state the plan places) needs
:mod:`bv_sharding.ops`; :mod:`bv_sharding.optimizers` holds the sharding-aware optimizers
(PSGD Kron, Shampoo, Muon); :mod:`bv_sharding.big_vision` stands in for big_vision's
``sharding`` and ``optax`` modules.
"""

from bv_sharding import big_vision, ops, optimizers
from bv_sharding import strategies as _builtin_ops  # noqa: F401  (registers the built-in ops)
from bv_sharding.aliases import deprecated as _deprecated
from bv_sharding.compute import gather_for_compute, save_anything_but_gathers
from bv_sharding.coverage import check_coverage
from bv_sharding.errors import Error, ShardingError, ShardingWarning
from bv_sharding.fingerprint import check_same_plan, line_checksums
from bv_sharding.mesh import make_abstract_mesh, make_mesh
from bv_sharding.planning import Entry, Plan, infer_sharding, plan
from bv_sharding.registry import (
    Op,
    OpInfo,
    lookup,
    parse_chain,
    register,
    registered,
    temporary_ops,
)

__all__ = [
    "Entry",
    "big_vision",
    "Error",
    "Op",
    "OpInfo",
    "Plan",
    "ShardingError",
    "ShardingWarning",
    "check_coverage",
    "check_same_plan",
    "gather_for_compute",
    "save_anything_but_gathers",
    "infer_sharding",
    "line_checksums",
    "lookup",
    "make_abstract_mesh",
    "make_mesh",
    "ops",
    "optimizers",
    "parse_chain",
    "plan",
    "register",
    "registered",
    "temporary_ops",
]

__getattr__ = _deprecated({"flatten_with_names": "bv_sharding.ops.flatten_with_names"}, __name__)
