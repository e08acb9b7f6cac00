"""Kron's pools holding their Qs where they run (``resident_padding``): the run whose Qs move to
the pools and back, the state given back to the params equal to its state, and an
``AbstractMesh``'s plan of the concrete mesh's shapes. Library imports only (SOAP's:
``test_soap.py``)."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import bv_sharding as bvs
from bv_sharding.optimizers import ParamLayout, canonical_state, kron
from tests.optimizers import own_loop, strategies

SHAPES, SPECS = strategies.TINY_SHAPES, strategies.TINY_SPECS
MESHES = {"8": (8, 1), "4x2": (4, 2)}


def _loss(params, k):
  return sum(jnp.sum(jnp.sin(p + 0.1 * k) ** 2 + 0.1 * p) for p in jax.tree.leaves(params))


def _make(layout, padding: float):
  return kron(
      1e-2,
      preconditioner_update_probability=1.0,
      block_size=8,
      layout=layout,
      resident_padding=padding,
  )


@functools.cache
def _run(mesh_name: str, padding: float):
  """``(params after 6 steps, plan mismatches, state as checkpointed, the state's pools)``."""
  data, model = MESHES[mesh_name]
  mesh = bvs.make_mesh([("data", data), ("model", model)], devices=jax.devices()[: data * model])
  make = functools.partial(_make, padding=padding)
  params, opt, plan = own_loop.train(make, SHAPES, SPECS, mesh, _loss, 6)
  mismatches = plan.mismatches({"params": params, "opt": opt})
  pools = jax.tree.map(lambda x: x.shape, opt[0].get("pools", ()))
  given = canonical_state(opt, params, ParamLayout(plan.specs["params"], mesh))
  return jax.device_get(params), mismatches, jax.device_get(given), pools


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mesh", sorted(MESHES))
def test_kron_pools_holding_their_qs_take_the_same_steps(mesh):
  moved, _, moved_state, none = _run(mesh, 0.0)
  got, mismatches, state, pools = _run(mesh, math.inf)
  assert none == () and pools, pools  # Held only when asked.
  assert mismatches == [], mismatches
  for name in SHAPES:
    np.testing.assert_allclose(got[name], moved[name], rtol=0, atol=1e-5, err_msg=name)
  assert jax.tree.structure(state) == jax.tree.structure(moved_state)
  for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(moved_state), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_kron_pools_planned_on_an_abstract_mesh_have_the_concrete_meshs_shapes():
  params = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in SHAPES.items()}
  specs = {k: jax.sharding.PartitionSpec(*v) for k, v in SPECS.items()}
  on = lambda mesh: _make(ParamLayout(specs, mesh), math.inf)
  abstract = on(jax.sharding.AbstractMesh((4, 2), ("data", "model")))
  concrete = on(bvs.make_mesh([("data", 4), ("model", 2)], devices=jax.devices()[:8]))
  same = lambda a, b: a == b and jax.tree.structure(a) == jax.tree.structure(b)
  state = jax.eval_shape(abstract.init, params)
  assert state[0]["pools"] and same(state, jax.eval_shape(concrete.init, params))
  _, stepped = jax.eval_shape(abstract.update, params, state, params)
  assert same(stepped, state)
