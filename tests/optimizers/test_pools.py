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
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import bv_sharding as bvs
from benchmarks import compile_time, traffic
from bv_sharding.optimizers import Tiling, kron, muon, shampoo, skipping, soap
from bv_sharding.optimizers.blocked import run_all
from bv_sharding.optimizers.shard_run import BlockRun
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
        1e-2,
        block_size=8,
        start_preconditioning_step=1,
        update_preconditioners_freq=1,
        layout=layout,
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


@pytest.mark.parametrize("laid_out", [True, False], ids=["layout", "no_layout"])
@pytest.mark.parametrize("name", ["kron", "shampoo", "kron_unblocked", "soap"])
def test_on_cpu_devices_no_collective_runs_under_a_cond(name, laid_out):
  """XLA:CPU keeps a ``lax.cond``'s collectives in no order with the step's others, and two
  devices taking them in different orders wait for each other forever (big_vision's Kron flow
  on a small ViT did, 1 run in 16). On CPU devices the pools make their gated moves every
  step and pick by the flag (the steps above check the values), and the fits and refreshes on
  sharded global arrays (without a layout, XLA puts collectives in them) are made every step
  and picked: the compiled step of a user's loop holds no collective in a cond. An
  accelerator's step skips them under ``lax.cond``, as ``skipping(True)`` compiles it."""
  make = {
      **SKIPPING,
      "soap": lambda layout: soap(1e-2, block_size=8, precondition_frequency=3, layout=layout),
  }[name]
  made = make if laid_out else lambda layout: make(None)
  mesh = bvs.make_mesh([("data", 4), ("model", 2)])
  in_conds = lambda hlo: [c for c in traffic.collectives(hlo) if c.branches]
  assert in_conds(own_loop.compiled_step(made, SHAPES, SPECS, mesh, _loss)) == []
  with skipping(True):
    assert in_conds(own_loop.compiled_step(made, SHAPES, SPECS, mesh, _loss))


@pytest.mark.parametrize("name", ["kron", "shampoo", "muon"])
def test_like_params_add_no_kernels(name):
  """Like params (the same shape, spec and tiles) run as one group of their pool (Muon: of
  their owners' stack), and each reads its member of the group's results at an index XLA
  cannot fold (``opaque.indices``): their update, state and apply compile to the same kernels
  however many there are (a pool of twice the tiles may fuse a few parts otherwise). Read at
  constant indices, each param added 1.5-4 kernels (on configs/lm.py medium, Kron's step
  570 -> 360 kernels, Muon's 361 -> 267)."""
  make = {**SKIPPING, "muon": lambda layout: muon(1e-2, layout=layout)}[name]
  mesh = bvs.make_mesh([("data", 8)])
  layers = lambda count: {f"layer{i}": (16, 16) for i in range(count)}
  kernels = {
      count: compile_time.kernels(
          own_loop.compiled_step(
              make, layers(count), {k: ("data",) for k in layers(count)}, mesh, _loss
          )
      )
      for count in (8, 16)
  }
  assert kernels[16] - kernels[8] <= 4, kernels  # At constant indices: 12 (Muon) to 30 more.


def test_like_params_drawn_whole_add_no_kernels():
  """Kron draws the probes of the params it fits whole (here 1-D scales) in one loop per shape,
  and each draw leaves the loop as its own array (``opaque.apart``): the kernels that read the
  probes are one per shape, however many like params there are. Read as rows of one stacked
  draw, each param added 3 (4 scales: 60 kernels, 8: 72; on configs/lm.py medium, Kron's step
  358 -> 310)."""
  mesh = bvs.make_mesh([("data", 8)])
  scales = lambda count: {f"scale{i}": (16,) for i in range(count)}
  kernels = {
      count: compile_time.kernels(
          own_loop.compiled_step(
              lambda layout: kron(1e-2, layout=layout),
              scales(count),
              {k: ("data",) for k in scales(count)},
              mesh,
              _loss,
          )
      )
      for count in (4, 8)
  }
  assert kernels[8] == kernels[4], kernels


@pytest.mark.parametrize("name, most", [("shampoo_every_step", 4), ("shampoo", 5), ("kron", 5)])
def test_a_pool_moves_its_arrays_and_factors_together(name, most):
  """What a pool moves each way under one flag, its arrays and its factor stacks, moves as one
  array of pieces: one all-to-all. Eight like 16 x 16 params over 8 devices, in tiles of 8
  (each tile's rows span four devices): the gradient's cut into tiles and its update's merge
  take one each, the pool one each way, and Shampoo's roots, read only on the steps between
  refreshes, one more. Moved one by one they took 8, 12 and 8."""
  mesh = bvs.make_mesh([("data", 8)])
  shapes = {f"layer{i}": (16, 16) for i in range(8)}
  hlo = own_loop.compiled_step(SKIPPING[name], shapes, {k: ("data",) for k in shapes}, mesh, _loss)
  assert len([c for c in traffic.collectives(hlo) if c.op == "all-to-all"]) <= most


@pytest.mark.parametrize("matrices, scales", [(3, 3), (8, 12)], ids=["padding", "added_slots"])
def test_a_small_pool_rides_in_a_bigger_one(matrices, scales):
  """A pool pads its tiles to a multiple of the device count, and its padding moves like its
  tiles. A pool whose pieces fit there rides in it (``pools.run_pools``): its tiles move in
  and back inside the bigger pool's all-to-alls and run on the devices that hold those slots.
  Three (16, 8) params in tiles of 8 make 6 tiles over 8 devices (2 padding slots); three
  never-sharded (8,) scales, a pool of their own, ride in them. Eight such params fill 16
  slots, no padding; twelve scales ride in one slot added to each device's share, three side
  by side (``pools.Seats``). Either way they add no all-to-all, and the steps are those on
  global arrays. (On configs/lm.py, Shampoo's norm scales rode in the padding: 6.50 -> 6.44 MB a
  step; on size=medium its 34 scale tiles ride in added slots: 8 -> 6 all-to-alls and 312 ->
  298 kernels, 0.2% more bytes.)"""
  mesh = bvs.make_mesh([("data", 8)])
  kernels = {f"w{i}": (16, 8) for i in range(matrices)}
  shapes = {**kernels, **{f"scale{i}": (8,) for i in range(scales)}}
  specs = {k: ("data",) if k in kernels else (None,) for k in shapes}
  make = SKIPPING["shampoo_every_step"]
  step = lambda shapes: own_loop.compiled_step(
      make, shapes, {k: specs[k] for k in shapes}, mesh, _loss
  )
  to_all = lambda shapes: [c for c in traffic.collectives(step(shapes)) if c.op == "all-to-all"]
  assert len(to_all(shapes)) == len(to_all(kernels))
  tiled, opt, plan = own_loop.train(make, shapes, specs, mesh, _loss, 3)
  assert plan.mismatches({"params": tiled, "opt": opt}) == []
  whole, _, _ = own_loop.train(lambda layout: make(None), shapes, specs, mesh, _loss, 3)
  for key in shapes:
    np.testing.assert_allclose(tiled[key], whole[key], atol=TOLERANCE["shampoo"], err_msg=key)


def test_a_pool_gives_each_params_sum_of_squares():
  """A run's ``squares`` (Kron's clip reads them): a pool sums its tiles' squares once, on the
  pieces that come back, and each param gets the sum over its tiles, as the param's own sum of
  squares: partial tiles (12 rows in tiles of 8), like params stacked, a param split on its
  columns (run turned), all in one pool on 4 x 2 devices."""
  mesh = bvs.make_mesh([("data", 4), ("model", 2)])
  specs = {"a": P("data", None), "b": P("data", None), "c": P(None, ("data", "model"))}
  shapes = {"a": (12, 8), "b": (12, 8), "c": (8, 16)}
  double = lambda arrays, stacks: ([2.0 * arrays[0]], stacks)  # Padding stays 0, as it must.
  runs = {
      k: BlockRun(Tiling(8).blocks(shapes[k], specs[k], mesh), double, [], [], turnable=True)
      for k in shapes
  }
  assert all(run.blocks.in_pool for run in runs.values())
  xs = {k: jnp.arange(np.prod(s), dtype=jnp.float32).reshape(s) / 50 for k, s in shapes.items()}

  def step(xs):
    ran = run_all([r._replace(arrays=[xs[k]], squares=[0]) for k, r in runs.items()])
    return {k: out for k, ((*out,), _) in zip(runs, ran)}

  with jax.set_mesh(mesh):
    placed = {k: jax.device_put(x, NamedSharding(mesh, specs[k])) for k, x in xs.items()}
    got = jax.jit(step)(placed)
  for k, x in xs.items():
    out, squares = got[k]
    np.testing.assert_allclose(out, 2.0 * x, rtol=1e-6)
    np.testing.assert_allclose(squares, np.sum(np.square(2.0 * x)), rtol=1e-5)
