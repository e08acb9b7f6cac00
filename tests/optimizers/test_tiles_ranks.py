"""Kron, Shampoo and Muon at the registry's defaults on params of every rank, on 8 simulated devices.

A ViT's tree has a 4-D conv embedding, 3-D attention kernels, 2-D MLP kernels, 1-D biases and
scales; a scanned model adds ``(L, m, n)`` stacks. Each rank is sharded on every dim that 8
divides on a mesh of 8, and over both axes of a 4x2 mesh, and planned as the trainer plans it
(``trainers/build.py``): the steps run, their updates are finite, the block stacks stay where the
plan stores them, and the params take the same steps as on one device. At the defaults
(256-tiles for Kron, 1024 for Shampoo) each of these tiny params is one tile that spans shards,
so its tiles are pooled over the mesh (``bv_sharding/optimizers/pools.py``).
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import bv_sharding as bvs
from bv_sharding.optimizers.placement import Stacks
from trainers import steps
from trainers.optimizers import ParamLayout, make_optimizer

# A ViT's ranks, tiny: a 4-D conv embedding (kh, kw, in, out), 3-D attention kernels (in, heads,
# head dim), 2-D MLP kernels, a 1-D bias and a 0-D scalar (Muon's Adam branch takes the last two).
SHAPES = {
    "scalar": (),
    "vector": (16,),
    "matrix_a": (8, 16),
    "matrix_b": (8, 16),
    "kernel_a": (8, 2, 16),
    "kernel_b": (8, 2, 16),
    "conv_a": (2, 2, 8, 16),
    "conv_b": (2, 2, 8, 16),
}
DATA, BOTH = "data", ("data", "model")
# On a mesh of 8 every rank on each dim that 8 divides; on 4x2 both axes on one dim, or "data" on
# one dim and "model" on another.
SPECS = {
    (8,): {
        "scalar": P(),
        "vector": P(DATA),
        "matrix_a": P(DATA),
        "matrix_b": P(None, DATA),
        "kernel_a": P(DATA),
        "kernel_b": P(None, None, DATA),
        "conv_a": P(None, None, DATA),
        "conv_b": P(None, None, None, DATA),
    },
    (4, 2): {
        "scalar": P(),
        "vector": P(BOTH),
        "matrix_a": P(DATA, "model"),
        "matrix_b": P("model", DATA),
        "kernel_a": P(DATA, "model"),
        "kernel_b": P(None, None, BOTH),
        "conv_a": P("model", None, DATA),
        "conv_b": P(None, "model", None, DATA),
    },
}
# Each optimizer's tests on one pytest-xdist worker, which then runs each of its meshes once.
OPTIMIZERS = [
    pytest.param(name, marks=pytest.mark.xdist_group(f"ranks-{name}"))
    for name in ("kron", "shampoo", "muon")
]
# Shampoo preconditions from the first step (its registry default waits 10 grafted steps).
OVERRIDES = {"shampoo": {"start_preconditioning_step": 1}}
STEPS = 3


def _strategy(specs) -> list[tuple[str, str]]:
  """Each leaf (its params and state entries) on its spec's dims: bv_sharding's ``shard_dim``."""
  out = []
  for name, spec in specs.items():
    ops = [
        f"shard_dim(axis={axes!r}, dim={dim}, ignore_ndim_error=True)"
        for dim, axes in enumerate(spec)
        if axes is not None
    ]
    out.append((f"(.*/)?{name}(/.*)?", "|".join(ops) or "replicate()"))
  return out


def _loss(params):
  return sum(jnp.sum(jnp.tanh(p) ** 2 + 0.1 * p) for p in jax.tree.leaves(params))


@functools.cache
def _run(name: str, mesh_shape: tuple[int, ...]):
  """``STEPS`` jitted steps of registry optimizer ``name`` planned as the trainer plans them, on
  a mesh of ``mesh_shape`` (one device: the specs of 8): ``(plan, tx, state, last updates)``."""
  axes = BOTH[: len(mesh_shape)]
  devices = jax.devices()[: math.prod(mesh_shape)]
  mesh = jax.make_mesh(mesh_shape, axes, axis_types=(AxisType.Auto,) * len(axes), devices=devices)
  keys = jax.random.split(jax.random.key(0), len(SHAPES))
  params = {k: jax.random.normal(key, shape) for key, (k, shape) in zip(keys, SHAPES.items())}
  strategy = _strategy(SPECS[mesh_shape if len(devices) > 1 else (8,)])
  params_plan = bvs.plan({"params": jax.eval_shape(lambda: params)}, strategy, mesh)
  layout = ParamLayout.from_plan(params_plan)
  tx = make_optimizer(name, 1e-2, layout=layout, **OVERRIDES.get(name, {}))
  # Complete as planned: the block stacks where the optimizer runs them (their Stacks declare it).
  plan = bvs.plan(steps.abstract_state(lambda: params, tx), strategy, mesh, params=params_plan)

  def steps_of(params, opt):
    def step(carry, _):
      params, opt = carry
      updates, opt = tx.update(jax.grad(_loss)(params), opt, params)
      return (jax.tree.map(jnp.add, params, updates), opt), updates

    (params, opt), updates = jax.lax.scan(step, (params, opt), None, STEPS)
    return params, opt, jax.tree.map(lambda u: u[-1], updates)

  with jax.set_mesh(mesh):
    state = steps.init_state(lambda: params, tx, plan)
    # No out_shardings: the state comes out where the update itself leaves it.
    run = jax.jit(steps_of, in_shardings=(plan.shardings["params"], plan.shardings["opt"]))
    params, opt, updates = run(state["params"], state["opt"])
  return plan, tx, {"params": params, "opt": opt}, jax.device_get(updates)


def _stacks(plan, tx, state) -> tuple[set[str], list[str]]:
  """The block stacks of ``state`` (Kron's, Shampoo's), and those the update left off the plan's
  spec."""
  del tx
  is_stacks = lambda x: isinstance(x, Stacks)
  nodes = jax.tree_util.tree_flatten_with_path({"opt": state["opt"]}, is_leaf=is_stacks)[0]
  stacks = {
      f"{bvs.names.leaf_name(path)}/{i}"
      for path, node in nodes
      if is_stacks(node)
      for i in range(len(node))
  }
  return stacks, [m for m in plan.mismatches(state) if m.split(":")[0] in stacks]


@pytest.mark.parametrize("mesh", SPECS, ids=["8", "4x2"])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_every_rank_sharded_on_every_dim_steps(name, mesh):
  plan, tx, state, updates = _run(name, mesh)
  for key, spec in SPECS[mesh].items():
    planned = plan.shardings["params"][key]  # On the dims asked.
    assert planned.is_equivalent_to(NamedSharding(planned.mesh, spec), len(SHAPES[key])), key
    assert np.isfinite(updates[key]).all() and np.abs(updates[key]).max() > 0, key
  stacks, misplaced = _stacks(plan, tx, state)
  assert misplaced == []
  if name != "muon":  # Each param of 2+ dims has its block stacks (Muon keeps none).
    blocked = {k for k, shape in SHAPES.items() if len(shape) >= 2}
    assert {k for k in blocked if any(f"/{k}/" in n for n in stacks)} == blocked, stacks


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_every_rank_takes_the_same_steps_on_any_mesh(name):
  one = _run(name, (1,))[2]["params"]
  for mesh in SPECS:
    params = _run(name, mesh)[2]["params"]
    for key in SHAPES:
      np.testing.assert_allclose(params[key], one[key], rtol=0, atol=1e-5, err_msg=f"{mesh} {key}")
