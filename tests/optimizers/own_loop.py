"""A user's own training loop on a mesh, for the optimizer tests (library imports only): the
params planned by their specs, the optimizer state born sharded by
``jax.jit(tx.init, out_shardings=...)``, and a step jitted without ``out_shardings``, so the
state comes back wherever the update left it (:func:`train`); or, to move a state between
meshes, a :class:`Loop` whose step is jitted into the plan, its state saved as host arrays and
restored onto another mesh's plan as a checkpointer would (:func:`saved`, :func:`restored`)."""

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

import bv_sharding as bvs
from bv_sharding.optimizers import ParamLayout, canonical_state, held_state
from tests.optimizers import strategies


def _params_plan(shapes: dict, specs: dict, mesh) -> bvs.Plan:
  """The plan of ``{"params": ...}``, float32 params of ``shapes`` placed by their specs."""
  params = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in shapes.items()}
  return bvs.plan({"params": params}, strategies.by_dims(specs), mesh)


def _setup(make_tx, shapes: dict, specs: dict, mesh):
  """``(tx, plan, abstract params)``: the params planned by their specs, the optimizer built on
  their layout, and the plan of params and state."""
  params_plan = _params_plan(shapes, specs, mesh)
  abstract = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in shapes.items()}
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


class Loop(NamedTuple):
  """A user's loop on one mesh: the optimizer, the plan of ``{"params", "opt"}``, its step of
  the loss (jitted into the plan's shardings: ``(state, loss before the update)``), and the
  state's form that does not depend on the mesh (Kron's and SOAP's pools given back to the
  params, :func:`~bv_sharding.optimizers.canonical_state`): its plan, and the conversions there
  and back, jitted into those plans."""

  tx: optax.GradientTransformation
  plan: bvs.Plan
  step: Callable
  canonical_plan: bvs.Plan
  to_canonical: Callable
  to_held: Callable


def _state_step(tx, loss):
  """:func:`_step` on ``{"params", "opt"}``, returning the loss before the update too."""
  step = _step(tx, loss)

  def state_step(state, k):
    params, opt = step(state["params"], state["opt"], k)
    return {"params": params, "opt": opt}, loss(state["params"], k)

  return state_step


def loop(make_tx, shapes: dict, specs: dict, mesh, loss) -> Loop:
  """The :class:`Loop` of ``make_tx(layout)`` and ``loss(params, k)`` on ``mesh``, params
  planned by their specs."""
  tx, plan, _ = _setup(make_tx, shapes, specs, mesh)
  layout, abstract = ParamLayout.from_plan(plan), plan.abstract()

  def canonical(state):
    return {**state, "opt": canonical_state(state["opt"], state["params"], layout)}

  def held(state):
    return {**state, "opt": held_state(state["opt"], abstract["opt"], state["params"], layout)}

  tree = jax.eval_shape(canonical, abstract)
  params_plan = _params_plan(shapes, specs, mesh)
  canonical_plan = bvs.plan(tree, strategies.by_dims(specs), mesh, params=params_plan)
  return Loop(
      tx,
      plan,
      jax.jit(_state_step(tx, loss), out_shardings=(plan.shardings, None)),
      canonical_plan,
      jax.jit(canonical, out_shardings=canonical_plan.shardings),
      jax.jit(held, out_shardings=plan.shardings),
  )


def born(run: Loop, params: dict) -> dict:
  """``{"params", "opt"}``: ``params`` (host arrays) put in the plan's shardings, the state
  born there by ``jax.jit(tx.init, out_shardings=...)``."""
  params = jax.device_put(params, run.plan.shardings["params"])
  with jax.set_mesh(run.plan.mesh):
    opt = jax.jit(run.tx.init, out_shardings=run.plan.shardings["opt"])(params)
  return {"params": params, "opt": opt}


def saved(run: Loop, state: dict) -> dict:
  """The state as a checkpoint holds it: host arrays, in the form of any mesh."""
  with jax.set_mesh(run.plan.mesh):
    return jax.device_get(run.to_canonical(state))


def restored(run: Loop, host: dict) -> dict:
  """:func:`saved`'s host arrays put onto ``run``'s mesh in its plan, its pools held again."""
  with jax.set_mesh(run.plan.mesh):
    return run.to_held(jax.device_put(host, run.canonical_plan.shardings))


def steps(run: Loop, state: dict, first: int, count: int):
  """``(state, losses, params)`` after ``count`` steps from step ``first``: ``losses`` measured
  before each update, ``params`` the host params after each."""
  losses, trail = [], []
  with jax.set_mesh(run.plan.mesh):
    for k in range(first, first + count):
      state, value = run.step(state, jnp.float32(k))
      losses.append(float(value))
      trail.append(jax.device_get(state["params"]))
  return state, losses, trail
