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


def _setup(make_tx, shapes: dict, specs: dict, mesh):
  """``(tx, plan, abstract params)``: the params planned by their specs, the optimizer built on
  their layout, and the plan of params and state."""
  abstract = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in shapes.items()}
  params_plan = bvs.plan({"params": abstract}, strategies.by_dims(specs), mesh)
  tx = make_tx(ParamLayout.from_plan(params_plan))
  tree = {"params": abstract, "opt": jax.eval_shape(tx.init, abstract)}
  plan = bvs.plan(tree, strategies.by_dims(specs), mesh, params=params_plan)
  return tx, plan, abstract


def _step(tx, loss):
  def step(params, opt, k):
    updates, opt = tx.update(jax.grad(loss)(params, k), opt, params)
    return optax.apply_updates(params, updates), opt

  return step


def train(make_tx, shapes: dict, specs: dict, mesh, loss, steps: int):
  """``(params, opt, plan)`` after ``steps`` steps of ``loss(params, k)`` from standard normal
  params (seed 0); ``make_tx(layout)`` builds the optimizer on the params' layout."""
  tx, plan, _ = _setup(make_tx, shapes, specs, mesh)
  rng = np.random.default_rng(0)
  params = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
  params = jax.device_put(params, plan.shardings["params"])
  with jax.set_mesh(mesh):
    opt = jax.jit(tx.init, out_shardings=plan.shardings["opt"])(params)
    step = jax.jit(_step(tx, loss))
    for k in range(steps):
      params, opt = step(params, opt, jnp.float32(k))
  return params, opt, plan


def compiled_step(make_tx, shapes: dict, specs: dict, mesh, loss) -> str:
  """The HLO text of :func:`train`'s step, compiled for params and state placed by the plan."""
  tx, plan, abstract = _setup(make_tx, shapes, specs, mesh)
  placed = lambda tree, shardings: jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings
  )
  params = placed(abstract, plan.shardings["params"])
  opt = placed(jax.eval_shape(tx.init, abstract), plan.shardings["opt"])
  with jax.set_mesh(mesh):
    return jax.jit(_step(tx, loss)).lower(params, opt, jnp.float32(0)).compile().as_text()
