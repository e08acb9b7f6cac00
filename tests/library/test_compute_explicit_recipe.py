"""The library recipe under Explicit axes: plan, init born sharded, gather for compute, update.

On a mesh from ``jax.make_mesh`` (Explicit axes), a flax MLP and ``optax.adam`` train one
step with params stored sharded and gathered to their compute specs inside the loss; the
step gives what the same code gives on an Auto mesh.
"""

import functools

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import bv_sharding as bvs

BATCH, WIDTH, HIDDEN = 16, 32, 64


FSDP = 'fsdp(axis="data", min_size_to_shard_mb=0)'
MEGATRON = [  # Column-parallel up, row-parallel down; both also stored over data (FSDP).
    (".*up/kernel", f'shard_dim(axis="model", dim=-1)|{FSDP}'),
    (".*down/kernel", f'shard_dim(axis="model", dim=-2)|{FSDP}'),
    (".*", "replicate()"),
]


class Mlp(nn.Module):
  """``down``'s matmul sums over ``model`` when the hidden dim is split: under Explicit axes
  its output sharding is ambiguous, so it is given one (``out``)."""

  out: NamedSharding | None = None

  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Dense(HIDDEN, name="up")(x))
    dot = functools.partial(jax.lax.dot_general, out_sharding=self.out)
    return nn.Dense(WIDTH, name="down", dot_general=dot)(x)


def recipe(mesh, strategy):
  """One step of the recipe: ``(plan, state, grads, new state)``."""
  explicit = AxisType.Explicit in mesh.axis_types
  model, tx = Mlp(NamedSharding(mesh, P("data")) if explicit else None), optax.adam(1e-2)
  x = np.random.default_rng(0).normal(size=(BATCH, WIDTH)).astype(np.float32)
  params_shape = jax.eval_shape(model.init, jax.random.key(0), x)["params"]
  opt_shape = jax.eval_shape(tx.init, params_shape)
  plan = bvs.plan({"params": params_shape, "opt": opt_shape}, strategy, mesh)

  def init():
    params = model.init(jax.random.key(0), x)["params"]
    return {"params": params, "opt": tx.init(params)}

  state = jax.jit(init, out_shardings=plan.shardings)()
  batch = jax.device_put(x, NamedSharding(mesh, P("data")))

  def loss(params, batch):
    y = model.apply({"params": bvs.gather_for_compute(params, plan)}, batch)
    return ((y - batch) ** 2).mean()

  @jax.jit
  def step(state, batch):
    grads = jax.grad(loss)(state["params"], batch)
    updates, opt = tx.update(grads, state["opt"], state["params"])
    return grads, {"params": optax.apply_updates(state["params"], updates), "opt": opt}

  grads, new = step(state, batch)
  return plan, state, grads, new


def assert_same_step(explicit, auto):
  for ours, theirs in zip(explicit[1:], auto[1:]):
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-6), ours, theirs)


@pytest.mark.parametrize(
    "shape, names, strategy, compute",
    [
        ((8,), ("data",), FSDP, P(None, None)),
        ((4, 2), ("data", "model"), MEGATRON, P(None, "model")),
    ],
    ids=["fsdp", "tensor_parallel+fsdp"],
)
def test_recipe_on_a_jax_make_mesh_matches_auto(shape, names, strategy, compute):
  mesh = jax.make_mesh(shape, names)
  assert set(mesh.axis_types) == {AxisType.Explicit}
  explicit = recipe(mesh, strategy)
  plan, state, grads, new = explicit
  up = plan.by_name()["params/up/kernel"]
  assert "data" in jax.tree.leaves(tuple(up.spec)) and up.compute_spec == compute
  assert "gathered for compute: data" in up.why
  assert (
      plan.by_name()["opt/0/mu/up/kernel"].compute_spec == plan.by_name()["opt/0/mu/up/kernel"].spec
  )
  # Born sharded, gradients back in the storage layout, the update keeps it.
  for tree in (state, new):
    assert plan.mismatches(tree) == []
  assert plan.mismatches({"params": grads, "opt": state["opt"]}) == []
  assert_same_step(
      explicit,
      recipe(jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(names)), strategy),
  )
