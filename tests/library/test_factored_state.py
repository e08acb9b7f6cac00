"""optax's Adafactor state placed by its own factored-dims rule (``optax.FactoredState``).

Issue 67: a square kernel's row and column statistics look alike to shape-based following, so
they stayed unsharded; the state type says which dim each keeps (optax's ``_factored_dims``).
A statistic that keeps none of its param's axes is split on its own dim over Auto axes only.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from optax._src import factorized

import bv_sharding as bvs
from bv_sharding.optimizers import factored

DIM, HIDDEN, VOCAB, LAYERS = 2048, 8192, 32768, 2
STRATEGY = 'fsdp(axis="data", min_size_to_shard_mb=0)'


def llama_like(dim=DIM, hidden=HIDDEN, vocab=VOCAB, layers=LAYERS) -> dict:
  """Abstract params: square attention kernels, MLP kernels, norms, embedding and head."""
  f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  layer = {
      **{name: f32(dim, dim) for name in ("q", "k", "v", "o")},
      "up": f32(dim, hidden),
      "down": f32(hidden, dim),
      "norm": f32(dim),
  }
  return {
      "embed": f32(vocab, dim),
      "head": f32(dim, vocab),
      **{f"layer_{i}": dict(layer) for i in range(layers)},
  }


def without(spec, dim: int) -> tuple:
  return tuple(entry for d, entry in enumerate(spec) if d != dim)


@pytest.mark.parametrize("shape", [(64, 64), (512, 128), (128, 512), (8, 64, 64), (3, 5, 4)])
def test_factored_dims_are_optaxs(shape):
  assert factored.factored_dims(shape) == factorized._factored_dims(shape, True, 0)


def llama_125m(layers: int = 12) -> dict:
  """The trainer's 125M Llama params, unscanned as configs/lm.py trains them: the names and
  shapes of ``trainers/models/llama.py``'s "125m" preset (d_model 768, d_ff 2048, vocab 32000)."""
  f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  dim, hidden, vocab = 768, 2048, 32_000
  layer = {
      "attention": {f"{n}_kernel": f32(dim, dim) for n in ("q", "k", "v", "out")},
      "attention_norm": {"scale": f32(dim)},
      "mlp": {
          "gate_kernel": f32(dim, hidden),
          "up_kernel": f32(dim, hidden),
          "down_kernel": f32(hidden, dim),
      },
      "mlp_norm": {"scale": f32(dim)},
  }
  return {
      "embed": {"embedding": f32(vocab, dim)},
      "final_norm": {"scale": f32(dim)},
      "lm_head": {"kernel": f32(dim, vocab)},
      **{f"layers_{i}": layer for i in range(layers)},
  }


# The trees and strategies: a Llama-like tree under plain FSDP, and the trainer's 125M Llama
# under configs/lm.py's strategy.
TREES = {
    "llama_like": (llama_like, STRATEGY),
    "trainer_125m": (llama_125m, 'llm_fsdp(axis="data", min_size_to_shard_mb=0)'),
}


@pytest.mark.parametrize("tree", TREES)
def test_adafactor_at_256_devices_near_ideal_with_each_factor_its_params_spec(tree):
  """Each statistic carries its param's axes on the dims it keeps; one that keeps none of
  them is split on its own dim on Auto axes (issue 67: 1.27x the ideal at 256 devices without)
  and stays unsharded on Explicit axes, as optax's update leaves it."""
  make, strategy = TREES[tree]
  params = make()
  tx = optax.adafactor(1e-3, min_dim_size_to_factor=32)
  tree = {"params": params, "opt": jax.eval_shape(tx.init, params)}
  mesh = lambda types: bvs.make_abstract_mesh([("data", -1)], 256, axis_types=types)
  auto, explicit = (bvs.plan(tree, strategy, mesh(types)) for types in ("auto", "explicit"))
  assert auto.bytes_per_device / (auto.total_bytes / 256) <= 1.05
  on_auto, on_explicit = auto.by_name(), explicit.by_name()
  for name, param in _flat(params):
    spec = tuple(on_auto[f"params/{name}"].spec)
    assert tuple(on_explicit[f"params/{name}"].spec) == spec
    if len(param.shape) < 2:  # Followed as Adam's moments: the param's spec, else the fallback's.
      for entries in (on_auto, on_explicit):
        v = entries[f"opt/0/v/{name}"]
        assert tuple(v.spec) == spec if any(spec) else v.sharded, name
      continue
    d1, d0 = factorized._factored_dims(param.shape, True, 32)
    for field, dropped in (("v_row", d0), ("v_col", d1)):
      carried, stat = without(spec, dropped), f"opt/0/{field}/{name}"
      assert tuple(on_explicit[stat].spec) == carried, stat
      assert tuple(on_auto[stat].spec) == carried if any(carried) else on_auto[stat].sharded, stat


def _flat(params) -> list:
  leaves = jax.tree_util.tree_flatten_with_path(params)[0]
  return [(jax.tree_util.keystr(path, simple=True, separator="/"), x) for path, x in leaves]


EXPLICIT, AUTO = jax.sharding.AxisType.Explicit, jax.sharding.AxisType.Auto
# (mesh axes and types, strategy) per case.
ON_EXPLICIT_AXES = {
    "data_first": ({"data": (8, EXPLICIT)}, [(".*", 'shard_dim(axis="data", dim=0)')]),
    "data_second": ({"data": (8, EXPLICIT)}, [(".*", 'shard_dim(axis="data", dim=-1)')]),
    "norms_replicated": (
        {"data": (8, EXPLICIT)},
        [("params/.*norm", "replicate()"), (".*", STRATEGY)],
    ),
    "mixed": ({"data": (4, EXPLICIT), "model": (2, AUTO)}, STRATEGY.replace("data", "model")),
}


@pytest.mark.parametrize("placed", ON_EXPLICIT_AXES)
def test_adafactor_update_jits_with_the_plans_shardings_on_explicit_axes(placed):
  """Legal on Explicit axes: the statistics keeping the param's unsharded dim stay unsharded
  there; the ``v`` of a norm the strategy replicates takes the fallback's axis, as Adam's
  moments do; on a mixed mesh a statistic takes an Auto axis of its own."""
  axes, strategy = ON_EXPLICIT_AXES[placed]
  sizes, types = zip(*axes.values())
  mesh = jax.make_mesh(sizes, tuple(axes), axis_types=types)
  params = llama_like(dim=64, hidden=128, vocab=256, layers=1)
  tx = optax.adafactor(1e-3, min_dim_size_to_factor=8)
  abstract = {"params": params, "opt": jax.eval_shape(tx.init, params)}
  shardings = bvs.plan(abstract, strategy, mesh).shardings
  p_sh, o_sh = shardings["params"], shardings["opt"]
  init = lambda: jax.tree.map(lambda x: jnp.full(x.shape, 0.5, x.dtype), params)
  with jax.set_mesh(mesh):
    w = jax.jit(init, out_shardings=p_sh)()
    state = jax.jit(tx.init, out_shardings=o_sh)(w)
    step = jax.jit(tx.update, in_shardings=(p_sh, o_sh, p_sh), out_shardings=(p_sh, o_sh))
    updates, state = step(w, state, w)
  planned = jax.tree.leaves(jax.tree.map(lambda s: s.spec, o_sh))
  if placed == "norms_replicated":
    assert p_sh["layer_0"]["norm"].spec == jax.P(None) != o_sh[0].v["layer_0"]["norm"].spec
  if placed == "mixed":  # q: P(None, "model"); its row statistic keeps the unsharded dim 0.
    assert o_sh[0].v_row["layer_0"]["q"].spec == jax.P("model")
  assert [x.sharding.spec for x in jax.tree.leaves(state)] == planned
  if AUTO not in types:  # The types carry the Explicit axes only.
    assert [jax.typeof(x).sharding.spec for x in jax.tree.leaves(state)] == planned
  assert all(np.isfinite(np.asarray(u)).all() for u in jax.tree.leaves(updates))
