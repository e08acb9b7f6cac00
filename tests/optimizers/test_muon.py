"""The project's Muon: optax's math on 2-D leaves, per layer on scanned stacks, and the same
update when each matrix is orthogonalised by one owner device."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from optax.contrib import MuonDimensionNumbers

import bv_sharding as bvs
from bv_sharding.optimizers.muon import muon, orthogonalize, scale_by_muon
from tests.optimizers import own_loop
from trainers.optimizers import OptimizerError, ParamLayout, make_optimizer

STEPS = 3


def _params(layers=None):
  lead = () if layers is None else (layers,)
  keys = iter(jax.random.split(jax.random.PRNGKey(0), 4))
  return {
      "kernel": jax.random.normal(next(keys), lead + (16, 32)),
      "down": jax.random.normal(next(keys), lead + (32, 16)),
      "norm": {"scale": jnp.ones(lead + (16,))},
  }


def _loss(params):
  return sum(jnp.mean(jnp.tanh(p) ** 2 + 0.1 * p) for p in jax.tree.leaves(params))


def _run(tx, params, shardings=None):
  state = tx.init(params)
  if shardings is not None:
    params = jax.device_put(params, shardings)

  @jax.jit
  def train(params, state):
    for _ in range(STEPS):
      updates, state = tx.update(jax.grad(_loss)(params), state, params)
      params = optax.apply_updates(params, updates)
    return params

  return jax.device_get(train(params, state))


def _close(a, b, tol=1e-5):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    assert np.max(np.abs(x - y)) <= tol * max(np.max(np.abs(y)), 1e-30)


def test_two_dim_leaves_follow_optax_muon():
  params = _params()
  _close(
      _run(muon(0.02, consistent_rms=None), params),
      _run(optax.contrib.muon(0.02, consistent_rms=None), params),
  )


def test_scanned_kernels_are_orthogonalised_per_layer_not_adam():
  stacked = _params(layers=3)
  state = make_optimizer("muon", 0.02).init(stacked)
  inner = state[0].inner_states
  assert not isinstance(inner["muon"].inner_state[0].mu["kernel"], optax.MaskedNode)
  assert isinstance(inner["adam"].inner_state[0].mu["kernel"], optax.MaskedNode)
  # Layer i of the scanned run equals the unscanned run of layer i alone.
  scanned = _run(muon(0.02), stacked)
  for i in range(3):
    layer = lambda tree, i=i: jax.tree.map(lambda x: x[i], tree)
    _close(layer(scanned), _run(muon(0.02), layer(stacked)))


@pytest.mark.timeout(300)
def test_leftovers_sharded_over_several_axes_reach_their_owners_without_replication(capfd):
  # A ViT's ranks on 4 x 2: each shape's matrices are fewer than the 8 owners, so all are
  # leftovers, sharded over both axes in different ways.
  mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  keys = iter(jax.random.split(jax.random.PRNGKey(1), 3))
  params = {
      "attn": jax.random.normal(next(keys), (16, 4, 8)),
      "conv": jax.random.normal(next(keys), (2, 2, 8, 16)),
      "dense": jax.random.normal(next(keys), (32, 16)),
  }
  specs = {
      "attn": P(None, "model", "data"),
      "conv": P(None, None, "data", "model"),
      "dense": P("data", "model"),
  }
  shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
  owned = _run(muon(0.02, layout=ParamLayout(specs, mesh)), params, shardings)
  assert "Involuntary full rematerialization" not in capfd.readouterr().err
  _close(owned, _run(muon(0.02), params))


@pytest.mark.timeout(300)
def test_owner_computed_orthogonalisation_equals_the_replicated_one():
  mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  params = _params(layers=5)  # 10 (16, 32) matrices: one round of 8 owners, 2 left over
  specs = {"kernel": P(None, "data", "model"), "down": P(None, "data"), "norm": {"scale": P()}}
  shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
  owned = _run(muon(0.02, layout=ParamLayout(specs, mesh)), params, shardings)
  _close(owned, _run(muon(0.02), params))


def test_scale_by_muon_gives_the_leaves_muon_does_not_orthogonalise_adam():
  """big_vision's form (no lr) on every rank: muon's updates (each matrix's scaled to the same
  ``consistent_rms``), its lr applied after."""
  keys = iter(jax.random.split(jax.random.PRNGKey(1), 6))
  params = {
      "conv": jax.random.normal(next(keys), (2, 2, 8, 4)),
      "kernel": jax.random.normal(next(keys), (6, 4, 2)),
      "w": jax.random.normal(next(keys), (8, 4)),
      "norm": {"scale": jax.random.normal(next(keys), (4,))},
      "bias": jax.random.normal(next(keys), (3, 4)),
      "t": jax.random.normal(next(keys), ()),
  }
  chained = optax.chain(scale_by_muon(), optax.scale_by_learning_rate(0.02))
  _close(_run(chained, params), _run(muon(0.02), params))
  mu = chained.init(params)[0].inner_states["muon"].inner_state[0].mu
  masked = lambda x: isinstance(x, optax.MaskedNode)
  orthogonalised = jax.tree.map(lambda x: not masked(x), mu, is_leaf=masked)
  assert orthogonalised == {
      "conv": True,
      "kernel": True,
      "w": True,
      "norm": {"scale": False},
      "bias": False,  # (3, 4), but a "bias"
      "t": False,
  }


def test_a_vector_given_to_newton_schulz_is_refused_with_the_fix():
  ns = lambda x: x
  with pytest.raises(OptimizerError, match=r"shape \(4,\) \(1 dims\).*scale_by_muon"):
    orthogonalize({"b": jnp.ones(4)}, {"b": MuonDimensionNumbers(0, 0)}, ns)


@pytest.mark.timeout(300)
def test_owners_send_updates_back_in_a_users_own_loop_as_the_replicated_update(capfd):
  # A user's loop (bv_sharding only) on 8 devices: a full round of a stack whose members are
  # held two ways (moved to the shared layout and back as runs), and leftovers of two shapes
  # zero-padded to (32, 64), cut back after the padded dim's axis moved onto the rows.
  mesh = bvs.make_mesh([("data", 8)])
  shapes = {"stack": (8, 32, 32), "a": (32, 32), "b": (32, 32), "up": (32, 64)}
  specs = {
      "stack": (None, None, "data"),
      "a": (None, "data"),
      "b": ("data", None),
      "up": (None, "data"),
  }
  loss = lambda params, k: sum(jnp.sum(jnp.sin(p + 0.1 * k) ** 2) for p in params.values())
  owned, opt, plan = own_loop.train(
      lambda layout: muon(0.02, layout=layout), shapes, specs, mesh, loss, STEPS
  )
  assert "Involuntary full rematerialization" not in capfd.readouterr().err
  assert plan.mismatches({"params": owned, "opt": opt}) == []
  replicated, _, _ = own_loop.train(lambda layout: muon(0.02), shapes, specs, mesh, loss, STEPS)
  _close(jax.device_get(owned), jax.device_get(replicated))
