"""A user's own training loop on a mesh, for the optimizer tests (library imports only): the
params planned by their specs, the optimizer state born sharded by
``jax.jit(tx.init, out_shardings=...)``, and a step jitted without ``out_shardings``, so the
state comes back wherever the update left it."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

import bv_sharding as bvs
from bv_sharding.optimizers import ParamLayout
from tests.optimizers import strategies


def train(make_tx, shapes: dict, specs: dict, mesh, loss, steps: int):
  """``(params, opt, plan)`` after ``steps`` steps of ``loss(params, k)`` from standard normal
  params (seed 0); ``make_tx(layout)`` builds the optimizer on the params' layout."""
  abstract = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in shapes.items()}
  params_plan = bvs.plan({"params": abstract}, strategies.by_dims(specs), mesh)
  tx = make_tx(ParamLayout.from_plan(params_plan))
  tree = {"params": abstract, "opt": jax.eval_shape(tx.init, abstract)}
  plan = bvs.plan(tree, strategies.by_dims(specs), mesh, params=params_plan)
  rng = np.random.default_rng(0)
  params = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
  params = jax.device_put(params, plan.shardings["params"])

  def step(params, opt, k):
    updates, opt = tx.update(jax.grad(loss)(params, k), opt, params)
    return optax.apply_updates(params, updates), opt

  with jax.set_mesh(mesh):
    opt = jax.jit(tx.init, out_shardings=plan.shardings["opt"])(params)
    step = jax.jit(step)
    for k in range(steps):
      params, opt = step(params, opt, jnp.float32(k))
  return params, opt, plan
