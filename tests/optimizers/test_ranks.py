"""Kron, Shampoo and Muon at the registry's defaults on params of every rank, on 8 simulated devices.

A ViT's tree has a 4-D conv embedding, 3-D attention kernels, 2-D MLP kernels and 1-D biases and
scales; a scanned model adds ``(L, m, n)`` stacks. Each rank is sharded on every dim the mesh
divides, on a 1-D mesh of 8 and a 4x2 mesh, and planned as the trainer plans it
(``trainers/build.py``): one jitted step runs, its updates are finite and its state comes out
where the plan puts it. At the defaults (256-tiles for Kron, 1024 for Shampoo) each of these tiny
params is one tile that spans shards, so its tiles are pooled (``layout.py``); their updates are
the same on 1, 2 and 8 devices and on 4x2.
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
from trainers import build, steps
from trainers.optimizers import ParamLayout, make_optimizer
from trainers.optimizers.layout import stack_blocks

# A ViT's ranks, tiny: a 4-D conv embedding (kh, kw, in, out), 3-D attention kernels (in, heads,
# head dim), a 2-D MLP kernel, a 1-D bias and a 0-D scalar (Muon's Adam branch takes the last two).
SHAPES = {0: (), 1: (16,), 2: (8, 16), 3: (8, 2, 16), 4: (2, 2, 8, 16)}
DATA, BOTH = "data", ("data", "model")
# Leaf name -> (rank, spec): on a mesh of 8 each rank on every dim that 8 divides; on 4x2 both
# axes on one dim, or "data" on one dim and "model" on another, for every rank.
PLACEMENTS = {
    "8": {
        "r0": (0, P()),
        "r1_d0": (1, P(DATA)),
        "r2_d0": (2, P(DATA)),
        "r2_d1": (2, P(None, DATA)),
        "r3_d0": (3, P(DATA)),
        "r3_d2": (3, P(None, None, DATA)),
        "r4_d2": (4, P(None, None, DATA)),
        "r4_d3": (4, P(None, None, None, DATA)),
    },
    "4x2": {
        "r0": (0, P()),
        "r1_d0": (1, P(BOTH)),
        "r2_d1_m0": (2, P("model", "data")),
        "r3_d0_m1": (3, P("data", "model")),
        "r3_d2": (3, P(None, None, BOTH)),
        "r4_d2_m0": (4, P("model", None, "data")),
        "r4_d3_m1": (4, P(None, "model", None, "data")),
    },
}
MESHES = {"8": (8,), "4x2": (4, 2)}


def _strategy(placements) -> list[tuple[str, str]]:
  """Each leaf (its params and state entries) on its spec's dims: bv_sharding's ``shard_dim``."""
  out = []
  for name, (_, spec) in placements.items():
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
def _run(name: str, placement: str, mesh_shape: tuple[int, ...], steps_run: int = 1, **kwargs):
  """``steps_run`` jitted steps of registry optimizer ``name`` (its defaults, ``kwargs`` over
  them) on ``PLACEMENTS[placement]``'s leaves, planned as the trainer plans them, on a mesh of
  ``mesh_shape`` over the first of its axes: ``(plan, tx, state, last updates)``."""
  placements = PLACEMENTS[placement]
  axes = BOTH[: len(mesh_shape)]
  devices = jax.devices()[: math.prod(mesh_shape)]
  mesh = jax.make_mesh(mesh_shape, axes, axis_types=(AxisType.Auto,) * len(axes), devices=devices)
  keys = jax.random.split(jax.random.key(0), len(placements))
  params = {k: jax.random.normal(key, SHAPES[r]) for key, (k, (r, _)) in zip(keys, placements.items())}
  strategy = _strategy(placements)
  params_plan = bvs.plan({"params": jax.eval_shape(lambda: params)}, strategy, mesh)
  tx = make_optimizer(name, 1e-2, layout=ParamLayout.from_plan(params_plan), **kwargs)
  plan = bvs.plan(steps.abstract_state(lambda: params, tx), strategy, mesh, params=params_plan)
  plan = build.stacks_placed(plan, tx)  # The block stacks where the trainer stores them.

  def step(params, opt):
    updates, opt = tx.update(jax.grad(_loss)(params), opt, params)
    return jax.tree.map(jnp.add, params, updates), opt, updates

  with jax.set_mesh(mesh):
    state = steps.init_state(lambda: params, tx, plan)
    # No out_shardings: the state comes out where the update itself leaves it.
    run = jax.jit(step, in_shardings=(plan.shardings["params"], plan.shardings["opt"]))
    params, opt = state["params"], state["opt"]
    for _ in range(steps_run):
      params, opt, updates = run(params, opt)
  return plan, tx, {"params": params, "opt": opt}, jax.device_get(updates)


def _stacks_misplaced(plan, tx, state) -> list[str]:
  """The block stacks of ``state`` that the update leaves off the plan's spec."""
  abstract = plan.abstract()
  blocks = stack_blocks(tx, abstract["params"], abstract["opt"])
  names = [name for name, _ in bvs.names.flatten({"opt": state["opt"]})[0]]
  stacks = {n for n, b in zip(names, blocks, strict=True) if b is not None}
  return [m for m in plan.mismatches(state) if m.split(":")[0] in stacks]


@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("name", ["kron", "shampoo", "muon"])
def test_every_rank_sharded_on_every_dim_steps(name, mesh):
  plan, tx, state, updates = _run(name, mesh, MESHES[mesh])
  for key, (_, spec) in PLACEMENTS[mesh].items():
    planned = plan.shardings["params"][key]  # On the dims asked:
    assert planned.is_equivalent_to(NamedSharding(planned.mesh, spec), updates[key].ndim), key
    assert np.isfinite(updates[key]).all() and np.abs(updates[key]).max() > 0, key
  assert _stacks_misplaced(plan, tx, state) == []
