"""Shard-local Kron and Shampoo blocks (bv_sharding/optimizers/tiles.py, shard_run.py, pools.py)
on 8 simulated devices.

The sharded update (``shard_map`` over each param's spec) must equal the unsharded
computation of the same blocking, move nothing but scalars between devices, and give
the same trajectory on any device count whose shards are multiples of the block size.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P

import bv_sharding as bvs
from benchmarks import traffic
from bv_sharding.optimizers import ParamLayout, kron, same_blocking, shampoo, soap
from bv_sharding.optimizers.blocked import turns
from bv_sharding.optimizers.tiles import shard_blocks

STEPS = 4


def _params():
  keys = iter(jax.random.split(jax.random.PRNGKey(0), 4))
  return {
      "embed": jax.random.normal(next(keys), (64, 16)),
      "kernel": jax.random.normal(next(keys), (16, 32)),
      "stack": jax.random.normal(next(keys), (2, 16, 32)),
      "scale": jnp.ones(16),
  }


SPECS = {
    "embed": P("data", "model"),
    "kernel": P(None, ("data", "model")),
    "stack": P(None, "data", "model"),
    "scale": P(),
}
SCANNED = {"embed": False, "kernel": False, "stack": True, "scale": False}


def _optimizer(name, layout):
  if name == "kron":
    return kron(
        1e-2,
        preconditioner_update_probability=1.0,
        block_size=4,
        scanned_layers=SCANNED,
        layout=layout,
    )
  return shampoo(1e-2, block_size=4, graft_type="adam", layout=layout)


def _loss(params):
  return sum(jnp.mean(jnp.tanh(p) ** 2 + 0.1 * p) for p in jax.tree.leaves(params))


def _run(tx, params, shardings=None, hlo=None, loss=_loss):
  """``STEPS`` updates of ``tx`` on ``params`` (on ``loss``); the compiled program's text
  appended to ``hlo`` when given."""
  state = tx.init(params)

  def step(carry, _):
    params, state = carry
    updates, state = tx.update(jax.grad(loss)(params), state, params)
    return (jax.tree.map(jnp.add, params, updates), state), None

  train = jax.jit(lambda p, s: jax.lax.scan(step, (p, s), None, STEPS)[0])
  if shardings is not None:
    params, state = jax.device_put((params, state), shardings)
  compiled = train.lower(params, state).compile()
  if hlo is not None:
    hlo.append(compiled.as_text())
  return jax.device_get(compiled(params, state))


def _mesh():
  return jax.make_mesh((4, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)


def _shardings(tx, layout, params):
  """Params on ``layout``'s specs and the state where ``bvs.plan`` puts it: block stacks where
  the optimizer runs them (their ``Stacks`` declare it), the rest following the params."""
  strategy = [
      (
          f"(.*/)?{name}(/.*)?",
          "|".join(f"shard_dim(axis={a!r}, dim={d})" for d, a in enumerate(spec) if a)
          or "replicate()",
      )
      for name, spec in layout.specs.items()
  ]
  tree = {"params": params, "opt": jax.eval_shape(tx.init, params)}
  plan = bvs.plan(tree, strategy, layout.mesh)
  assert plan.specs["params"] == {
      k: P(*s, *(None,) * (params[k].ndim - len(s))) for k, s in layout.specs.items()
  }
  return plan.shardings["params"], plan.shardings["opt"]


@pytest.fixture(scope="module")
def runs():
  """name -> (sharded run on a 4x2 mesh, unsharded run of the same blocking)."""
  params, mesh = _params(), _mesh()
  out = {}
  for name in ("kron", "shampoo"):
    sharded = ParamLayout(SPECS, mesh)
    tx = _optimizer(name, sharded)
    on_mesh = _run(tx, params, _shardings(tx, sharded, params))
    reference = _run(_optimizer(name, ParamLayout(SPECS, mesh.abstract_mesh)), params)
    out[name] = (on_mesh, reference)
  return out


@pytest.mark.timeout(600)
@pytest.mark.xdist_group("layout-runs")  # One worker makes `runs` for both.
@pytest.mark.parametrize("name", ["kron", "shampoo"])
def test_sharded_update_equals_the_unsharded_one_of_the_same_blocking(name, runs):
  on_mesh, reference = runs[name]
  for a, b in zip(jax.tree.leaves(on_mesh), jax.tree.leaves(reference)):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    scale = max(np.max(np.abs(b)), 1e-30)
    assert np.max(np.abs(a - b)) / scale <= 1e-5


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", ["kron", "shampoo"])
def test_update_moves_only_scalars(name):
  params, mesh = _params(), _mesh()
  layout = ParamLayout(SPECS, mesh)
  tx = _optimizer(name, layout)
  param_shardings, state_shardings = _shardings(tx, layout, params)
  abstract = lambda tree, s: jax.tree.map(
      lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), tree, s
  )
  p = abstract(params, param_shardings)
  opt = abstract(jax.eval_shape(tx.init, params), state_shardings)
  update = jax.jit(
      lambda g, o, p: tx.update(g, o, p), out_shardings=(param_shardings, state_shardings)
  )
  hlo = update.lower(p, opt, p).compile().as_text()
  sizes = [c.result_bytes for c in traffic.collectives(hlo)]
  # A few fused f32 scalars at most; under Shampoo the never-sharded scale's 4 tiles of 4 are
  # pooled over the 8 devices: its pool of 4 x 4 statistics (8 x 16 f32) moves, no param's data.
  allowed = 8 * 4 if name == "kron" else 8 * 4 * 4 * 4
  assert sizes and max(sizes) <= allowed, sizes


@pytest.mark.timeout(300)
def test_blocks_and_trajectory_do_not_depend_on_the_device_count():
  """The param's 16-row tiles on 2, 4 and 8 devices (8-row shards: tiles span two), the same
  params; shard-local blocks ("local") are 8 rows on 8 devices: other tiles."""
  params = {"w": jax.random.normal(jax.random.PRNGKey(3), (64, 16))}
  layout = lambda n: ParamLayout({"w": P("data")}, AbstractMesh((n,), ("data",)))
  blocks = lambda n, blocking="tiles": layout(n).blocks_of(params, 16, blocking=blocking)["w"]
  assert same_blocking(blocks(2), blocks(4)) and same_blocking(blocks(4), blocks(8))
  assert not same_blocking(blocks(4, "local"), blocks(8, "local"))
  tx = lambda n: kron(1e-2, preconditioner_update_probability=1.0, block_size=16, layout=layout(n))
  runs = [_run(tx(n), params) for n in (2, 4, 8)]
  for run in runs[1:]:
    np.testing.assert_allclose(runs[0][0]["w"], run[0]["w"], rtol=1e-5, atol=1e-6)
    qs = [r[1][0]["Qs_preconditioners"]["w"][0] for r in (runs[0], run)]
    np.testing.assert_allclose(qs[0], qs[1], rtol=1e-5, atol=1e-6)  # The same state, in order.


def _sixteen_tiles(name):
  """Kron (fitting every step) or Shampoo with 16-tiles, on a layout (None: global arrays)."""
  return lambda layout: (
      kron(1e-2, preconditioner_update_probability=1.0, block_size=16, layout=layout)
      if name == "kron"
      else shampoo(1e-2, block_size=16, graft_type="adam", layout=layout)
  )


def _run_on(mesh, make, params, specs):
  """(the run on ``mesh``, the run on global arrays, the plan's shardings, the mesh run's
  compiled program)."""
  layout = ParamLayout(specs, mesh)
  tx = make(layout)
  shardings, hlo = _shardings(tx, layout, params), []
  on_mesh = _run(tx, params, shardings, hlo)
  return on_mesh, _run(make(None), params), shardings, hlo[0]


# On 8 devices, rows over "data", 16-row tiles in 8- or 2-row shards: a's tiles span pairs of
# shards and deal to them (collective permutes within each pair), b's span all 8 shards and
# deal one per device (one all-to-all), c's 4 tiles cannot be dealt to 8 holders: pooled
# (dealt over the mesh with the padding of the pool, its shards moved by XLA).
SPANNING = {"a": (64, 32), "b": (16, 128), "c": (16, 64)}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", ["kron", "shampoo"])
def test_tiles_spanning_shards_are_fitted_by_their_owners(name):
  params = {k: jax.random.normal(jax.random.key(i), s) for i, (k, s) in enumerate(SPANNING.items())}
  specs = {k: P("data") for k in SPANNING}
  mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  blocks = {k: shard_blocks(s, P("data"), mesh, 16) for k, s in SPANNING.items()}
  assert [blocks[k].owners for k in SPANNING] == [(0, "data", 2), (0, "data", 8), None]
  assert [blocks[k].pooled for k in SPANNING] == [False, False, True]
  on_mesh, reference, _, hlo = _run_on(mesh, _sixteen_tiles(name), params, specs)
  for k in SPANNING:
    np.testing.assert_allclose(on_mesh[0][k], reference[0][k], rtol=1e-5, atol=1e-6)
  if name == "kron":  # Each factor is that of its own tile, stored at the tile's place.
    for k in SPANNING:
      qs = [r[1][0]["Qs_preconditioners"][k][0] for r in (on_mesh, reference)]
      np.testing.assert_allclose(qs[0], qs[1], rtol=1e-5, atol=1e-6)
  found = {(c.op, c.result_bytes) for c in traffic.collectives(hlo)}
  piece = lambda k: np.prod(SPANNING[k]) * 4 // 8  # One device's f32 shard of a param.
  assert ("all-to-all", 2 * piece("b")) in found or ("all-to-all", piece("b")) in found, found
  assert ("collective-permute", piece("a") // 2) in found, found
  assert not [b for op, b in found if op == "all-gather"], found  # Nothing is gathered whole.


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", ["kron", "shampoo"])
def test_tiles_pooled_in_their_layout_run_where_another_layout_holds_them_whole(name):
  """A 128 x 24 head split on its columns over 8 devices: 3-column shards cut its 16-tiles,
  which no holder owns (pooled, its factors moved every step), but its rows split 8 ways hold
  whole tiles. Its blocks run there: the grad moves in and the direction back (one all-to-all
  of a shard each), the factors stay where they are stored, and the steps are the global ones."""
  mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  blocks = shard_blocks((128, 24), P(None, "data"), mesh, 16)
  assert (blocks.relaid_from, blocks.spec, blocks.pooled) == ((None, "data"), ("data", None), False)
  params, specs = {"head": jax.random.normal(jax.random.key(0), (128, 24))}, {
      "head": P(None, "data")
  }
  on_mesh, reference, shardings, hlo = _run_on(mesh, _sixteen_tiles(name), params, specs)
  np.testing.assert_allclose(on_mesh[0]["head"], reference[0]["head"], rtol=1e-5, atol=1e-6)
  stacks = [s for s in jax.tree.leaves(shardings[1]) if len(s.spec) == 4]  # (8, 2, b, b) each
  assert stacks and all(s.spec == P("data", None, None, None) for s in stacks)
  found = traffic.collectives(hlo)
  moved = [(c.op, c.result_bytes) for c in found if c.op != "all-reduce"]
  assert moved == [("all-to-all", 128 * 24 * 4 // 8)] * 2, found  # One f32 shard each.
  assert all(c.result_bytes <= 8 for c in found if c.op == "all-reduce"), found  # Scalars.


def test_a_layouts_stacked_leaves_are_krons_scanned_layers():
  """A layout's ``stacked`` leaves reach Kron as its ``scanned_layers``: the same state and steps
  as Kron given them itself, each layer of the stack its own Qs; without them the stack's layer
  axis is a tensor dim with a factor of its own."""
  params, mesh = _params(), _mesh().abstract_mesh
  make = lambda layout, scanned=None: kron(
      1e-2,
      preconditioner_update_probability=1.0,
      block_size=4,
      scanned_layers=scanned,
      layout=layout,
  )
  stacked = make(ParamLayout(SPECS, mesh, stacked=SCANNED))
  given = make(ParamLayout(SPECS, mesh), SCANNED)
  qs = lambda tx: [
      q.shape for q in jax.eval_shape(tx.init, params)[0]["Qs_preconditioners"]["stack"]
  ]
  assert qs(stacked) == qs(given) == [(2, 4, 8, 3, 4)] * 2  # Layers first, then each one's grid.
  assert len(qs(make(ParamLayout(SPECS, mesh)))) == 3
  for a, b in zip(jax.tree.leaves(_run(stacked, params)), jax.tree.leaves(_run(given, params))):
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("name", ["shampoo", "soap"])
def test_shampoo_and_soap_cut_a_layouts_stacked_leaves_layer_by_layer(name):
  """Shampoo and SOAP on a layout's ``stacked`` leaf: its layers' tiles, statistics, bases and
  norms (Shampoo's grafting, SOAP's ``normalize_grads``) are each layer's own, so the stack's
  steps are those of its layers trained as separate params."""
  params, mesh = _params(), _mesh().abstract_mesh
  make = lambda layout: (
      shampoo(0.1, block_size=4, graft_type="adam", start_preconditioning_step=1, layout=layout)
      if name == "shampoo"
      else soap(1e-2, block_size=4, precondition_frequency=2, normalize_grads=True, layout=layout)
  )
  stacked = _run(make(ParamLayout(SPECS, mesh, stacked=SCANNED)), params)[0]["stack"]
  layers = {**params, "stack": None, "layer0": params["stack"][0], "layer1": params["stack"][1]}
  specs = {**SPECS, "stack": None, "layer0": P("data", "model"), "layer1": P("data", "model")}
  # The stack's mean is the mean of its layers' means: the same gradients, layer by layer.
  weight = lambda k: 0.5 if k.startswith("layer") else 1.0
  loss = lambda p: sum(weight(k) * _loss(v) for k, v in p.items() if v is not None)
  apart = _run(make(ParamLayout(specs, mesh)), layers, loss=loss)[0]
  for i in range(2):  # Float32 reduction order: a few ulps of values near 2 (1.7e-6 seen).
    np.testing.assert_allclose(stacked[i], apart[f"layer{i}"], rtol=4e-6, atol=1e-6)
  unstacked = _run(make(ParamLayout(SPECS, mesh)), params)[0]["stack"]
  assert np.max(np.abs(unstacked - stacked)) > 1e-4  # The layer axis a tensor dim: other math.


# On 8 devices with 4-tiles, every tile spans shards and is pooled. A matrix and a stack of two
# layers' matrices split on their columns alone (square tiles, 3 x 2 of them a matrix, which a
# turned run reads in another order), and a matrix of tall tiles
# (4 x 2), run turned (``blocked.turns``): the tall tiles join the wide ones (2 x 4) of the
# last param, which runs as it is.
TURNED = {
    "cols": ((12, 8), P(None, "data"), False),
    "stack": ((2, 12, 8), P(None, None, "data"), True),
    "tall": ((8, 2), P("data", None), False),
    "wide": ((2, 8), P(None, "data"), False),
}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", ["kron", "shampoo", "soap"])
def test_turned_tiles_step_as_their_params_own_tiles(name):
  """Params whose pools run them transposed take the steps they take on global arrays (Kron's
  probes drawn as the params' own, transposed). SOAP's are compared with its steps on the
  transposed params: its first Adam step divides rotated coordinates that are zero but for
  float rounding (the gradient is diagonal in the bases fitted to it) by their own magnitude,
  so another order of the same sums moves those coordinates by up to the learning rate (against
  its steps on the params themselves, 9e-4 of the params after 4 steps)."""
  mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  params = {
      k: jax.random.normal(jax.random.key(i), s) for i, (k, (s, _, _)) in enumerate(TURNED.items())
  }
  specs = {k: spec for k, (_, spec, _) in TURNED.items()}
  stacked = {k: scanned for k, (_, _, scanned) in TURNED.items()}
  blocks = {k: shard_blocks(s, spec, mesh, 4, scanned) for k, (s, spec, scanned) in TURNED.items()}
  assert all(b.pooled for b in blocks.values())
  turned = {k: turns(blocks[k]) for k in TURNED}
  assert list(turned.values()) == [True, True, True, False]
  make = lambda layout: (
      kron(1e-2, preconditioner_update_probability=1.0, block_size=4, layout=layout)
      if name == "kron"
      else shampoo(1e-2, block_size=4, graft_type="adam", layout=layout)
      if name == "shampoo"
      else soap(1e-2, block_size=4, precondition_frequency=2, layout=layout)
  )
  layout = ParamLayout(specs, mesh, stacked=stacked)
  tx = make(layout)
  on_mesh = _run(tx, params, _shardings(tx, layout, params))[0]
  turn = lambda k, x: jnp.swapaxes(x, -1, -2) if turned[k] and name == "soap" else x
  flip = lambda k, spec: P(*spec[:-2], spec[-1], spec[-2]) if turned[k] and name == "soap" else spec
  global_layout = ParamLayout(
      {k: flip(k, P(*s, *(None,) * (params[k].ndim - len(s)))) for k, s in specs.items()},
      mesh.abstract_mesh,
      stacked=stacked,
  )
  reference = _run(make(global_layout), {k: turn(k, x) for k, x in params.items()})[0]
  tol = 1e-4 if name == "soap" else 1e-5  # SOAP: within 2.2e-5 of it (2026-12-05).
  for k in TURNED:
    np.testing.assert_allclose(on_mesh[k], turn(k, reference[k]), rtol=tol, atol=tol / 10)
