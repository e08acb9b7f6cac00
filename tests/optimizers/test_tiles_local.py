"""Shard-local blocks (``blocking="local"``) and the mesh-independent tiles (``"tiles"``, the
default: pooled over the mesh, dealt to owners) keep every param, update and state leaf where
the plan puts it, in a loop that jits its step without ``out_shardings``, and compile without
an involuntary full rematerialization (a ViT's ranks on 4 x 2: before the pools moved one run
of mesh axes at a time, ``pools.axis_steps``, the tiles printed it for the attention kernel,
the conv embedding and the scanned stack). Library imports only."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import bv_sharding as bvs
from bv_sharding.optimizers import kron, shampoo, soap
from tests.optimizers import own_loop, strategies

SHAPES, SPECS = strategies.VIT_SHAPES, strategies.VIT_SPECS
OPTIMIZERS = {
    "kron": lambda layout: kron(1e-2, preconditioner_update_probability=1.0, **layout),
    # Roots refreshed every other step: under lax.cond, as a rarer refresh compiles them.
    "shampoo": lambda layout: shampoo(1e-2, update_preconditioners_freq=2, **layout),
    "soap": lambda layout: soap(1e-2, precondition_frequency=2, **layout),
}


def _loss(params, k):
  return sum(jnp.sum(jnp.sin(p + 0.1 * k) ** 2 + 0.1 * p) for p in jax.tree.leaves(params))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("blocking", ["local", "tiles"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_blocks_keep_params_and_state_where_planned_without_remat(name, blocking, capfd):
  mesh = bvs.make_mesh([("data", 4), ("model", 2)])
  make = lambda layout: OPTIMIZERS[name]({"layout": layout, "blocking": blocking, "block_size": 8})
  params, opt, plan = own_loop.train(make, SHAPES, SPECS, mesh, _loss, 3)
  assert plan.mismatches({"params": params, "opt": opt}) == []
  assert all(np.isfinite(x).all() for x in jax.tree.leaves(jax.device_get(params)))
  assert "Involuntary full rematerialization" not in capfd.readouterr().err


@pytest.mark.parametrize("name", ["kron", "shampoo"])
def test_like_shard_local_params_share_one_program(name):
  """Shard-local tiles of like params (the same tile shape and state) are fitted in one call
  per device: the compiled update of four such params holds as many conditionals (the fit or
  root refresh under ``lax.cond``) as that of one, and each param's update is the one it gets
  with a twin beside it (the tiles' work is block by block)."""
  mesh = bvs.make_mesh([("data", 8)])
  spec = jax.sharding.PartitionSpec("data", None)

  def update(count):
    params = {
        f"w{i}": jnp.linspace(-1.0, 1.0, 64 * 16).reshape(64, 16) * (i + 1) for i in range(count)
    }
    layout = bvs.optimizers.ParamLayout({k: spec for k in params}, mesh)
    tx = OPTIMIZERS[name]({"layout": layout, "block_size": 8})
    step = jax.jit(lambda g, s: tx.update(g, s, g)[0])
    state = jax.jit(tx.init)(params)
    conditionals = step.lower(params, state).compile().as_text().count(" conditional(")
    return conditionals, step(params, state)

  one, _ = update(1)
  four, updates = update(4)
  assert one >= 1 and four == one, (one, four)
  _, two = update(2)
  for k in two:
    np.testing.assert_allclose(updates[k], two[k], rtol=1e-5, atol=1e-7)
