"""Shard-local blocks (``blocking="local"``) keep every param, update and state leaf where the
plan puts it, in a loop that jits its step without ``out_shardings``, and compile without an
involuntary full rematerialization (a ViT's ranks on 4 x 2). Library imports only."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import bv_sharding as bvs
from bv_sharding.optimizers import ParamLayout, kron, shampoo, soap
from tests.optimizers import strategies

SHAPES, SPECS = strategies.VIT_SHAPES, strategies.VIT_SPECS
OPTIMIZERS = {
    "kron": lambda layout: kron(1e-2, preconditioner_update_probability=1.0, **layout),
    "shampoo": lambda layout: shampoo(1e-2, **layout),
    "soap": lambda layout: soap(1e-2, precondition_frequency=2, **layout),
}


def _loss(params, k):
  return sum(jnp.sum(jnp.sin(p + 0.1 * k) ** 2 + 0.1 * p) for p in jax.tree.leaves(params))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_shard_local_blocks_keep_params_and_state_where_planned(name, capfd):
  mesh = bvs.make_mesh([("data", 4), ("model", 2)])
  abstract = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in SHAPES.items()}
  params_plan = bvs.plan({"params": abstract}, strategies.by_dims(SPECS), mesh)
  layout = ParamLayout.from_plan(params_plan)
  tx = OPTIMIZERS[name]({"layout": layout, "blocking": "local", "block_size": 8})
  tree = {"params": abstract, "opt": jax.eval_shape(tx.init, abstract)}
  plan = bvs.plan(tree, strategies.by_dims(SPECS), mesh, params=params_plan)
  rng = np.random.default_rng(0)
  params = {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}
  params = jax.device_put(params, plan.shardings["params"])

  def step(params, opt, k):
    updates, opt = tx.update(jax.grad(_loss)(params, k), opt, params)
    return optax.apply_updates(params, updates), opt

  with jax.set_mesh(mesh):
    opt = jax.jit(tx.init, out_shardings=plan.shardings["opt"])(params)
    step = jax.jit(step)
    for k in range(3):
      params, opt = step(params, opt, jnp.float32(k))
  assert plan.mismatches({"params": params, "opt": opt}) == []
  assert all(np.isfinite(x).all() for x in jax.tree.leaves(jax.device_get(params)))
  assert "Involuntary full rematerialization" not in capfd.readouterr().err
