"""Kron and Shampoo under jit on 8 simulated CPU devices with sharded state.

Batched LAPACK calls inside ``lax.cond`` can deadlock XLA:CPU with several
devices; these optimizers keep their linear algebra out of ``lax.cond``. Each
case runs 20 jitted steps, three times, under a timeout, and checks that the
runs are finite and identical.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from trainers.optimizers import kron, precond_update_prob_schedule, shampoo

STEPS, REPEATS, DEVICES = 20, 3, 8


def _params():
  key = iter(jax.random.split(jax.random.PRNGKey(1), 4))
  return {
      "embed": jax.random.normal(next(key), (32, 16)),
      "blocks": {  # stacked layers: leading axis of 2
          "kernel": jax.random.normal(next(key), (2, 16, 32)),
          "norm": {"scale": jnp.ones((2, 16))},
      },
      "head": {"bias": jnp.zeros(32)},
  }


def _loss(params):
  return sum(jnp.mean(jnp.tanh(p) ** 2 + 0.1 * p) for p in jax.tree.leaves(params))


def _spec(x, layout):
  """Replicated, or the largest dim divisible by the device count on 'data'."""
  dims = [i for i, d in enumerate(x.shape) if d % DEVICES == 0]
  if layout == "replicated" or not dims:
    return P()
  axis = max(dims, key=lambda i: x.shape[i])
  return P(*[("data" if i == axis else None) for i in range(x.ndim)])


OPTIMIZERS = {
    "kron": lambda: kron(
        1e-2,
        preconditioner_update_probability=precond_update_prob_schedule(
            min_prob=0.2, decay=0.3, flat_start=5
        ),
    ),
    "kron_scanned": lambda: kron(
        1e-2,
        preconditioner_update_probability=0.5,
        scanned_layers={
            "embed": False,
            "head": {"bias": False},
            "blocks": {"kernel": True, "norm": {"scale": True}},
        },
    ),
    "shampoo": lambda: shampoo(1e-2, block_size=8, update_preconditioners_freq=3),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("layout", ["replicated", "largest_dim"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_sharded_jit_steps_do_not_deadlock(name, layout):
  assert jax.device_count() >= DEVICES, "needs jax_num_cpu_devices=8 (conftest)"
  mesh = jax.make_mesh((DEVICES,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  tx = OPTIMIZERS[name]()
  params = _params()
  tree = (params, tx.init(params))
  shardings = jax.tree.map(lambda x: NamedSharding(mesh, _spec(x, layout)), tree)

  @jax.jit
  def train(params, state):
    def step(carry, _):
      params, state = carry
      updates, state = tx.update(jax.grad(_loss)(params), state, params)
      return (jax.tree.map(jnp.add, params, updates), state), None

    carry, _ = jax.lax.scan(step, (params, state), None, STEPS)
    return jax.lax.with_sharding_constraint(carry, shardings)

  finals = []
  for _ in range(REPEATS):
    params, state = train(*jax.device_put(tree, shardings))
    finals.append(jax.device_get(params))
  leaves = [jax.tree.leaves(f) for f in finals]
  assert all(np.isfinite(x).all() for x in leaves[0])
  for other in leaves[1:]:
    for a, b in zip(leaves[0], other):
      np.testing.assert_array_equal(a, b)
  kept = jax.tree.map(lambda x, s: x.sharding.is_equivalent_to(s, x.ndim), state, shardings[1])
  assert all(jax.tree.leaves(kept))


LAPACK = {"eigh", "triangular_solve"}


def _equations(jaxpr, inside_cond=False):
  """(equation, whether it sits under a cond) for every equation, sub-jaxprs included."""
  for eqn in jaxpr.eqns:
    yield eqn, inside_cond
    for sub in jax.core.jaxprs_in_params(eqn.params):
      yield from _equations(sub, inside_cond or eqn.primitive.name == "cond")


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_update_has_no_batched_or_conditional_linear_algebra(name):
  """The design guarantee itself: every LAPACK call takes one matrix (a batched call
  waits on XLA's CPU thread pool and deadlocks multi-device CPU) and none sits
  under a cond."""
  tx = OPTIMIZERS[name]()
  params = _params()
  jaxpr = jax.make_jaxpr(tx.update)(params, tx.init(params), params).jaxpr
  calls = [(e, c) for e, c in _equations(jaxpr) if e.primitive.name in LAPACK]
  assert calls
  for eqn, under_cond in calls:
    assert not under_cond, eqn
    assert all(v.aval.ndim == 2 for v in eqn.invars), eqn
