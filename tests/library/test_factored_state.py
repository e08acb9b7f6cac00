"""optax's Adafactor state placed by its own factored-dims rule (``optax.FactoredState``).

Issue 67: a square kernel's row and column statistics look alike to shape-based following, so
they stayed unsharded; the state type says which dim each keeps (optax's ``_factored_dims``).
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


def test_adafactor_at_256_devices_near_ideal_with_each_factor_its_params_spec():
  params = llama_like()
  tx = optax.adafactor(1e-3, min_dim_size_to_factor=32)
  tree = {"params": params, "opt": jax.eval_shape(tx.init, params)}
  p = bvs.plan(tree, STRATEGY, bvs.make_abstract_mesh([("data", -1)], 256))
  assert p.bytes_per_device / (p.total_bytes / 256) <= 1.05
  entries = p.by_name()
  for name, param in _flat(params):
    spec = tuple(entries[f"params/{name}"].spec)
    if len(param.shape) < 2:
      assert tuple(entries[f"opt/0/v/{name}"].spec) == spec
      continue
    d1, d0 = factorized._factored_dims(param.shape, True, 32)
    assert tuple(entries[f"opt/0/v_row/{name}"].spec) == without(spec, d0), name
    assert tuple(entries[f"opt/0/v_col/{name}"].spec) == without(spec, d1), name
  square = entries["opt/0/v_row/layer_0/q"], entries["opt/0/v_col/layer_0/q"]
  assert any(tuple(e.spec) != (None,) for e in square)  # issue 67: no longer both unsharded


def _flat(params) -> list:
  leaves = jax.tree_util.tree_flatten_with_path(params)[0]
  return [(jax.tree_util.keystr(path, simple=True, separator="/"), x) for path, x in leaves]


@pytest.mark.parametrize("placed", ["data_first", "data_second"])
def test_adafactor_update_jits_with_the_plans_shardings_on_explicit_axes(placed):
  mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
  params = llama_like(dim=64, hidden=128, vocab=256, layers=1)
  tx = optax.adafactor(1e-3, min_dim_size_to_factor=8)
  dim = -1 if placed == "data_second" else 0
  strategy = f'shard_dim(axis="data", dim={dim})'
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
  assert [jax.typeof(x).sharding.spec for x in jax.tree.leaves(state)] == planned
  assert all(np.isfinite(np.asarray(u)).all() for u in jax.tree.leaves(updates))
