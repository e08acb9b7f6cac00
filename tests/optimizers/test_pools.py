"""Kron between its fits and Shampoo between its refreshes: a step that does not fit Q (or
refresh the roots) leaves the pooled factors where they are stored, and is still the step the
same optimizer takes on global arrays. Four steps on a ViT's ranks (4 x 2 mesh, 8-tiles:
pooled, dealt and local ones): Kron fits every other step, Shampoo refreshes every third, so
a step reads the factors a step without a fit or refresh left; Shampoo refreshing every step
keeps no roots; unblocked Kron fits each param as one tile of its own shape. Library imports
only."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import bv_sharding as bvs
from bv_sharding.optimizers import ParamLayout, kron, shampoo
from tests.optimizers import own_loop, strategies

SHAPES, SPECS = strategies.VIT_SHAPES, strategies.VIT_SPECS
SKIPPING = {
    "kron": lambda layout: kron(
        1e-2, preconditioner_update_probability=0.5, block_size=8, layout=layout
    ),
    "shampoo": lambda layout: shampoo(
        1e-2,
        block_size=8,
        start_preconditioning_step=1,
        update_preconditioners_freq=3,
        layout=layout,
    ),
    # Every step refreshes the roots: the state keeps none, and the pools move none.
    "shampoo_every_step": lambda layout: shampoo(
        1e-2, block_size=8, start_preconditioning_step=1, layout=layout
    ),
    # Unblocked: each param one tile of its own shape, fitted whole by one device.
    "kron_unblocked": lambda layout: kron(
        1e-2, preconditioner_update_probability=0.5, block_size=None, layout=layout
    ),
}
# Shampoo's roots of one gradient's statistics (start_preconditioning_step=1) have nearly equal
# eigenvalues, whose eigh turns with the float order: the bias differs by 3.6e-5 on the mesh,
# as before the gating. A stale or missing factor moves a param by about the lr (1e-2).
TOLERANCE = {"kron": 2e-6, "kron_unblocked": 2e-6, "shampoo": 1e-4, "shampoo_every_step": 1e-4}


def _loss(params, k):
  return sum(jnp.sum(jnp.sin(p + 0.1 * k) ** 2 + 0.1 * p) for p in jax.tree.leaves(params))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(SKIPPING))
def test_steps_between_fits_match_global_arrays(name):
  mesh = bvs.make_mesh([("data", 4), ("model", 2)])
  make = SKIPPING[name]
  tiled, opt, plan = own_loop.train(make, SHAPES, SPECS, mesh, _loss, 4)
  assert plan.mismatches({"params": tiled, "opt": opt}) == []
  whole, _, _ = own_loop.train(lambda layout: make(None), SHAPES, SPECS, mesh, _loss, 4)
  for key in SHAPES:
    np.testing.assert_allclose(tiled[key], whole[key], atol=TOLERANCE[name], err_msg=key)


def _jaxprs_in(params: dict):
  """The jaxprs an equation's params hold (a cond's branches, a jit's or shard_map's body)."""
  for value in params.values():
    for x in value if isinstance(value, (tuple, list)) else (value,):
      if isinstance(x, jax.extend.core.ClosedJaxpr):
        yield x.jaxpr
      elif isinstance(x, jax.extend.core.Jaxpr):
        yield x


def _moving(eqn) -> bool:
  """Whether ``eqn`` is or holds a sharding constraint (where XLA may place a collective)."""
  return eqn.primitive.name == "sharding_constraint" or any(
      any(map(_moving, jaxpr.eqns)) for jaxpr in _jaxprs_in(eqn.params)
  )


def _pooled(eqn) -> bool:
  """Whether ``eqn`` was made by a pool (``pools.run_pool``), by its source's traceback."""
  return "optimizers/pools.py" in str(eqn.source_info.traceback)


def _unordered_moves(jaxpr) -> list[tuple[int, int]]:
  """Pairs of ``jaxpr``'s equations a pool made, a ``cond`` that moves data and another move,
  neither of which reads (through any chain of equations) what the other one makes."""
  made_by, before = {}, []
  for i, eqn in enumerate(jaxpr.eqns):
    inputs = [made_by[v] for v in eqn.invars if isinstance(v, jax.extend.core.Var) and v in made_by]
    before.append(set().union(*(before[j] | {j} for j in inputs)))
    made_by.update({v: i for v in eqn.outvars})
  moves = [i for i, eqn in enumerate(jaxpr.eqns) if _moving(eqn) and _pooled(eqn)]
  conds = [i for i in moves if jaxpr.eqns[i].primitive.name == "cond"]
  return [
      (c, m) for c in conds for m in moves if m != c and c not in before[m] and m not in before[c]
  ]


@pytest.mark.parametrize("name", ["kron", "shampoo", "kron_unblocked"])
def test_each_gated_move_waits_for_the_moves_before_it_and_the_rest_for_it(name):
  """XLA:CPU orders a step's collectives among themselves but not with a ``lax.cond`` that
  holds some (a pool's gated moves): started in another order on two devices they wait for each
  other forever (big_vision's Kron flow on a small ViT did, 1 run in 16). Each such cond of
  the update must read what every other move before it makes, or be read by it."""
  mesh = bvs.make_mesh([("data", 4), ("model", 2)])
  abstract = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in SHAPES.items()}
  params_plan = bvs.plan({"params": abstract}, strategies.by_dims(SPECS), mesh)
  tx = SKIPPING[name](ParamLayout.from_plan(params_plan))
  step = lambda params, opt, k: tx.update(jax.grad(_loss)(params, k), opt, params)
  with jax.set_mesh(mesh):
    jaxpr = jax.make_jaxpr(step)(abstract, jax.eval_shape(tx.init, abstract), 0.0).jaxpr
  conds = [e for e in jaxpr.eqns if e.primitive.name == "cond" and _moving(e)]
  assert conds, "no gated move to order"
  assert _unordered_moves(jaxpr) == []
