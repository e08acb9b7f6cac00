"""The project's SOAP: the authors' reference trajectory, float32 state, and the same trajectory on
any mesh with its state where the plan puts it.

The reference (github nikhilvyas/SOAP, PyTorch) was run once outside the project by
``tools/record_soap_reference.py``; its problem, settings and params after each of 20 steps are
in ``tests/data/soap_reference.npz``. Library imports only.
"""

import functools
import importlib
import json
import math
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import bv_sharding as bvs
from bv_sharding.optimizers import (
    canonical_state,
    gating,
    rebirth,
    scale_by_soap,
    soap,
    with_state_dtype,
)
from tests.optimizers import own_loop, strategies

soap_module = importlib.import_module("bv_sharding.optimizers.soap")  # soap is also a function
REFERENCE = pathlib.Path(__file__).parents[1] / "data/soap_reference.npz"


@functools.cache
def _reference():
  data = np.load(REFERENCE)
  return {k: data[k] for k in data.files}


def _tree(data, prefix: str) -> dict[str, np.ndarray]:
  return {k.split("/", 1)[1]: v for k, v in data.items() if k.startswith(prefix + "/")}


def _replay(settings: dict, data) -> dict[str, np.ndarray]:
  """Our ``soap`` on the recorded problem: the params after each step, ``(steps, *shape)``."""
  settings = dict(settings)
  lr = settings.pop("lr")
  if "betas" in settings:
    settings["betas"] = tuple(settings["betas"])
  # The reference's defaults, then the run's settings; tiles as large as the params (the
  # reference preconditions each param whole), its own bases (eigh, then sorted QR
  # refreshes), no pools.
  reference = dict(
      betas=(0.95, 0.95),
      shampoo_beta=-1,
      eps=1e-8,
      weight_decay=0.01,
      precondition_frequency=10,
      max_precond_dim=10000,
      merge_dims=False,
      precondition_1d=False,
      normalize_grads=False,
      correct_bias=True,
      power_damping=0.0,
      relative_eps=0.0,
      resident_padding=0.0,
  )
  tx = soap(lr, block_size=64, **{**reference, **settings})
  h, target, noise = (_tree(data, k) for k in ("h", "target", "noise"))
  params = jax.tree.map(jnp.asarray, _tree(data, "init"))

  def step(carry, noise_k):
    params, state = carry
    grads = jax.tree.map(lambda p, h, t, z: h * (p - t) + z, params, h, target, noise_k)
    updates, state = tx.update(grads, state, params)
    params = optax.apply_updates(params, updates)
    return (params, state), params

  _, steps = jax.jit(lambda p, n: jax.lax.scan(step, (p, tx.init(p)), n))(params, noise)
  return jax.device_get(steps)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("run", ["default", "decay_normalized", "merged"])
def test_soap_matches_the_authors_reference(run):
  """Measured: at most 3e-6 over 20 steps (float32 on both sides), bases refreshed (QR) every
  2-4 steps, with the reference's weight decay, normalize_grads and merge_dims."""
  data = _reference()
  ours = _replay(json.loads(str(data["runs"]))[run], data)
  theirs = _tree(data, run)
  assert set(ours) == set(theirs)
  for name in theirs:
    assert ours[name].shape == theirs[name].shape
    worst = float(np.max(np.abs(ours[name] - theirs[name])))
    assert worst < 1e-4, (name, worst)
  # It moved: the comparison is not of two standing still.
  assert max(float(np.max(np.abs(theirs[n][-1] - data[f"init/{n}"]))) for n in theirs) > 0.1


def test_statistics_and_bases_are_float32_moments_like_the_params():
  params = {"w": jnp.ones((8, 4), jnp.bfloat16), "b": jnp.ones(4, jnp.bfloat16)}
  for tx in (
      scale_by_soap(block_size=4),
      with_state_dtype(scale_by_soap(block_size=4), "bfloat16"),
  ):
    state = jax.eval_shape(tx.init, params).per_param
    assert {x.dtype for x in (*state["w"].stats, *state["w"].bases)} == {jnp.dtype("float32")}
    assert state["w"].mu.dtype == state["b"].nu.dtype == jnp.bfloat16
  assert [s.shape for s in state["w"].bases] == [(2, 1, 4, 4), (2, 1, 4, 4)]
  assert state["b"].bases == ()  # 1-D: Adam


# Tiny params on a data x model mesh: shard-local 8-tiles, tiles spanning shards (dealt to
# owners or pooled over the mesh), a never-sharded rotated matrix, and an Adam bias.
SHAPES, SPECS = strategies.TINY_SHAPES, strategies.TINY_SPECS
MESHES = {"1": (1, 1), "2": (2, 1), "4": (4, 1), "8": (8, 1), "4x2": (4, 2)}
STEPS = 20


def _loss(params, k):
  """A loss whose gradient changes every step (``k``): SOAP moves nothing on its first step,
  and the same gradient again would be diagonal in its own statistics' bases, where Adam's
  first step takes the sign of round-off."""
  total = 0.0
  for p in jax.tree.leaves(params):
    wave = jnp.sin(1.7 * k + 0.37 * jnp.arange(p.size, dtype=p.dtype).reshape(p.shape))
    total += jnp.sum(jnp.sin(p) ** 2 + 0.1 * p + 0.3 * wave * p)
  return total


# The bases that follow the statistics continuously, so that the trajectory is the same on any
# mesh: with the default (0, the reference's bases) a step's float rounding chooses the
# eigenvectors of nearly equal eigenvalues, and a program compiled another way (another mesh,
# or pools that move the bases back only when they change) parts from one device's by 3.4e-4
# over these 20 steps.
STABLE = {"power_damping": 1e-2, "relative_eps": 1e-3}


@functools.cache
def _trajectory(mesh_name: str, blocking: str = "tiles", resident: float = 0.0):
  """``(params after STEPS steps, state's mismatches with its plan, the state's shapes)`` on
  ``mesh_name``, its blocks cut by ``blocking``, its pools' state kept where they run up to
  ``resident`` times their tiles' (``resident_padding``)."""
  data, model = MESHES[mesh_name]
  mesh = bvs.make_mesh([("data", data), ("model", model)], devices=jax.devices()[: data * model])
  make = lambda layout: soap(
      3e-2,
      precondition_frequency=3,
      block_size=8,
      layout=layout,
      blocking=blocking,
      **STABLE,
      resident_padding=resident,
  )
  params, opt, plan = own_loop.train(make, SHAPES, SPECS, mesh, _loss, STEPS)
  shapes = jax.tree.map(lambda x: x.shape, opt)
  mismatches = plan.mismatches({"params": params, "opt": opt})
  if resident:  # The state given back to the params, as a checkpoint for another mesh.
    opt = canonical_state(opt, params, bvs.optimizers.ParamLayout(plan.specs["params"], mesh))
  return jax.device_get(params), mismatches, shapes, jax.device_get(opt)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mesh", ["2", "4", "8", "4x2"])
def test_same_trajectory_on_any_mesh_and_state_placed_as_planned(mesh):
  one, mismatches, _, _ = _trajectory("1")
  assert mismatches == []
  got, mismatches, _, _ = _trajectory(mesh)
  assert mismatches == [], mismatches
  for name in SHAPES:
    worst = float(np.max(np.abs(got[name] - one[name])))
    assert worst <= 1e-4, (mesh, name, worst)
  start = np.random.default_rng(0).standard_normal(SHAPES["dense"])
  assert float(np.max(np.abs(one["dense"] - start))) > 0.1  # It moved.


def _low_rank(steps: int, shape, rank: int, seed: int) -> np.ndarray:
  """Gradients of rank ``rank`` (a few tokens' worth a step), ``(steps, *shape)``: most of
  their statistics' eigenvalues are zero, or nearly, after one step."""
  rng = np.random.default_rng(seed)
  (m, n), draw = shape, rng.standard_normal
  return np.stack([draw((m, rank)) @ draw((rank, n)) for _ in range(steps)]).astype(np.float32)


def _walk(tx, grads: jax.Array) -> jax.Array:
  """The sum of ``tx``'s updates of a param given ``grads`` one step each."""

  def step(carry, g):
    total, state = carry
    updates, state = tx.update({"w": g}, state)
    return (total + updates["w"], state), None

  zero = jnp.zeros(grads.shape[1:])
  return jax.lax.scan(step, (zero, tx.init({"w": zero})), grads)[0][0]


@pytest.mark.parametrize("seed", [0, 1])
def test_power_bases_move_with_the_gradients_rounding_and_eighs_do_not(seed):
  """The gradients scaled by 1 + 1e-7 noise, as another mesh's reduction order rounds them:
  with ``power_damping`` SOAP's steps move by about as much (measured 2e-5 to 4e-5 of the
  largest over 12 steps), while the reference's bases (``eigh`` of statistics whose eigenvalues
  nearly coincide) turn freely (0.3-0.6)."""
  grads = _low_rank(12, (24, 16), 2, seed)
  noise = np.random.default_rng(seed + 10).standard_normal(grads.shape)
  rounded = (grads * (1 + 1e-7 * noise)).astype(np.float32)

  def gap(**settings) -> float:
    walk = jax.jit(
        functools.partial(_walk, scale_by_soap(precondition_frequency=4, block_size=64, **settings))
    )
    a, b = (np.asarray(walk(jnp.asarray(g))) for g in (grads, rounded))
    return float(np.max(np.abs(a - b)) / np.max(np.abs(a)))

  assert gap(power_damping=0.0) > 0.1
  assert gap(power_damping=1e-2) < 1e-4
  assert gap(power_damping=1e-2, relative_eps=1e-3) < 1e-3


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mesh", ["8", "4x2"])
def test_resident_pools_take_the_same_steps_holding_their_state_where_they_run(mesh):
  """``resident_padding``: the pooled tiles' moments and factors live in one array per pool
  and kind, split over every device on its slots (the plan places them so and the step keeps
  them there), and the run is the one-device run and the one whose state moves to the pools
  and back each step (measured: within 4e-6 of the latter over 20 steps; a program compiled
  another way rounds another way). Given back to the params (``canonical_state``), its state
  is the latter's."""
  one, _, _, _ = _trajectory("1")
  moved, _, moved_shapes, moved_opt = _trajectory(mesh)
  got, mismatches, shapes, opt = _trajectory(mesh, resident=math.inf)
  assert mismatches == [], mismatches
  for name in SHAPES:
    np.testing.assert_allclose(got[name], moved[name], rtol=0, atol=2e-5, err_msg=name)
    np.testing.assert_allclose(got[name], one[name], rtol=0, atol=1e-4, err_msg=name)
  devices = int(np.prod(MESHES[mesh]))
  is_shape = lambda x: isinstance(x, tuple) and all(isinstance(d, int) for d in x)
  pools = jax.tree.leaves(shapes[0].pools, is_leaf=is_shape)
  assert pools and all(shape[0] % devices == 0 for shape in pools), pools
  # The pooled params keep no moments of their own; the shard-local ones keep theirs.
  kept = {name for name, s in shapes[0].per_param.items() if s.mu is not None}
  assert "bias" in kept and kept < set(SHAPES), kept
  assert all(moved_shapes[0].per_param[name].mu is not None for name in SHAPES)
  assert jax.tree.structure(opt) == jax.tree.structure(moved_opt)
  for a, b in zip(jax.tree.leaves(opt), jax.tree.leaves(moved_opt)):
    np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-4)


def test_resident_pools_planned_on_an_abstract_mesh_have_the_concrete_meshs_shapes():
  """Planned on an ``AbstractMesh`` (``jax.eval_shape``: a plan, a memory estimate) the state
  has the shapes and tree it has on a concrete mesh of that shape, and a step on global arrays
  (the state given back to the params, stepped and held again) keeps them."""
  params = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in SHAPES.items()}
  specs = {k: jax.sharding.PartitionSpec(*v) for k, v in SPECS.items()}
  make = lambda mesh: soap(
      3e-2, block_size=8, resident_padding=math.inf, layout=bvs.optimizers.ParamLayout(specs, mesh)
  )
  abstract = make(jax.sharding.AbstractMesh((4, 2), ("data", "model")))
  concrete = make(bvs.make_mesh([("data", 4), ("model", 2)], devices=jax.devices()[:8]))
  same = lambda a, b: a == b and jax.tree.structure(a) == jax.tree.structure(b)  # where, too
  state = jax.eval_shape(abstract.init, params)
  assert same(state, jax.eval_shape(concrete.init, params))
  assert state[0].pools
  _, stepped = jax.eval_shape(abstract.update, params, state, params)
  assert same(stepped, state)


@pytest.mark.timeout(600)
def test_shard_local_blocks_are_the_tiles_on_one_device_and_cut_by_the_shards_on_eight():
  """``blocking="local"``: on one device a shard is the whole param, so its blocks and
  trajectory are the tiles'; on 4x2 each block lies within a shard (other, smaller blocks),
  placed as planned, and it still trains."""
  tiles, _, tile_shapes, _ = _trajectory("1")
  local, mismatches, local_shapes, _ = _trajectory("1", "local")
  assert mismatches == [] and local_shapes == tile_shapes
  for name in SHAPES:
    np.testing.assert_allclose(local[name], tiles[name], atol=1e-6)
  sharded, mismatches, sharded_shapes, _ = _trajectory("4x2", "local")
  assert mismatches == [], mismatches
  assert sharded_shapes != tile_shapes
  # "dense" (32, 16) on data 4 x model 2: (8, 8) shards, 8-blocks either way; "attn" (16, 4, 8)
  # split (None, model, data): 2-wide pieces of its last two dims, whose tiles are 4 and 8 wide.
  assert sharded_shapes[0].per_param["attn"].bases != tile_shapes[0].per_param["attn"].bases
  start = np.random.default_rng(0).standard_normal(SHAPES["attn"])
  assert np.isfinite(sharded["attn"]).all() and float(np.max(np.abs(sharded["attn"] - start))) > 0.1


def test_precondition_1d_rotates_a_vector_as_its_column_and_otherwise_leaves_it_to_adam():
  """A 1-D param with ``precondition_1d`` trains as the same values shaped (n, 1) (a unit dim
  is dropped, so SOAP always rotates that one); without it, as Adam."""
  grads = [jnp.sin(jnp.arange(12.0) * (k + 1)) for k in range(6)]

  def run(tx, shape):
    state, out = tx.init(jnp.zeros(shape)), []
    for g in grads:
      update, state = jax.jit(tx.update)(g.reshape(shape), state)
      out.append(update.reshape(-1))
    return np.stack(out), state

  rotated, state = run(
      scale_by_soap(block_size=16, precondition_1d=True, precondition_frequency=2), (12,)
  )
  column, _ = run(scale_by_soap(block_size=16, precondition_frequency=2), (12, 1))
  adam, adam_state = run(scale_by_soap(block_size=16, precondition_frequency=2), (12,))
  assert [b.shape for b in state.per_param.bases] == [(1, 12, 12)]  # One block, the whole.
  assert adam_state.per_param.bases == ()
  np.testing.assert_allclose(rotated, column, atol=1e-6)
  assert float(np.max(np.abs(rotated - adam))) > 0.1


def test_big_visions_spelling_builds_scale_by_soap():
  tx = bvs.big_vision.transformations.transformation(
      "bv_sharding.scale_by_soap", {"block_size": 4, "precondition_frequency": 2}
  )
  state = tx.init({"w": jnp.ones((8, 4))})
  assert [b.shape for b in state.per_param["w"].bases] == [(2, 1, 4, 4), (2, 1, 4, 4)]


def test_a_state_born_mid_run_moves_at_its_first_step():
  """Born mid-run (``rebirth.moving``: count 1), SOAP's first update is Adam's first in the
  bases it is born with (``I``); its bases are then those a fresh run fits on its first step,
  and its moments that gradient's alone, re-expressed in them."""
  tx = scale_by_soap(block_size=8)
  grads = {"w": jax.random.normal(jax.random.key(0), (8, 4)), "b": jnp.arange(1.0, 5.0)}
  update = jax.jit(tx.update)
  _, fresh = update(grads, tx.init(grads))
  updates, state = update(grads, rebirth.moving(tx.init(grads)))
  adam = optax.scale_by_adam(0.95, 0.95, eps=1e-8)
  want = adam.update(grads, adam.init(grads))[0]
  for name in grads:
    np.testing.assert_allclose(updates[name], want[name], rtol=1e-5)
  q0, q1 = (np.asarray(q[0, 0]) for q in state.per_param["w"].bases)
  for got, fitted in zip(state.per_param["w"].bases, fresh.per_param["w"].bases):
    np.testing.assert_array_equal(got, fitted)
  rotated = q0.T @ np.asarray(grads["w"]) @ q1
  np.testing.assert_allclose(state.per_param["w"].mu, 0.05 * rotated, atol=1e-6)
  np.testing.assert_allclose(state.per_param["w"].nu, 0.05 * rotated**2, atol=1e-6)


def test_a_tile_no_gradient_reaches_is_fitted_only_on_the_step_its_first_gradient_comes(
    monkeypatch,
):
  """An embedding's tiles of tokens the data never holds keep zero statistics: the bases'
  refit (``eigh``, QR: the costly part of a refresh) runs on no step for them, only when some
  tile's statistics become nonzero, and on refresh steps."""
  refits = []
  new_bases = soap_module._new_bases

  def counted(*args, **kwargs):
    jax.debug.callback(lambda: refits.append(1))
    return new_bases(*args, **kwargs)

  monkeypatch.setattr(soap_module, "_new_bases", counted)
  tx = scale_by_soap(block_size=8, precondition_frequency=10)
  rows = jax.random.normal(jax.random.key(0), (16, 4))
  reached = lambda tiles: jnp.where(jnp.arange(16)[:, None] < 8 * tiles, rows, 0.0)
  with gating.skipping(True):  # The refit under lax.cond, as on an accelerator.
    update = jax.jit(tx.update)
    state = tx.init({"w": rows})
    ran = []
    for tiles in (1, 1, 1, 2, 2):  # The second tile's first gradient at the fourth step.
      _, state = update({"w": reached(tiles)}, state)
      jax.effects_barrier()
      ran.append(len(refits))
      if len(ran) == 3:
        bases = [np.asarray(q[1, 0]) for q in state.per_param["w"].bases]
        assert all((q == np.eye(len(q))).all() for q in bases)  # Still born: no gradient.
  assert ran == [1, 1, 1, 2, 2]
  fitted = state.per_param["w"].bases[0][1, 0]
  assert float(jnp.max(jnp.abs(fitted - jnp.eye(8)))) > 0.1
