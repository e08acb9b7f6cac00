"""The trainer's real train step with Kron/Shampoo and owner-computed Muon on a 2-D mesh (8
simulated devices): XLA compiles it without "Involuntary full rematerialization", into no more
kernels over adamw's than measured (what compile time grows with), and it moves at most its
goal in adamw's bytes (docs/optimizers.md): shard-local blocks 1.10x, the default
tiles 1.25x, Muon 1.25x (the momentum to the owners and the update back, all-to-alls of about
a shard's bytes), on a step that fits or refreshes and on one between, and SOAP with its
pools holding their state 1.25x, on every config. Each row is also held to the figure measured
on this tiny config, so a regression shows even under its goal.
"""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import bv_sharding as bvs
from benchmarks import compile_time, step_traffic, traffic
from trainers import build

config_with = step_traffic.config_for  # What the benchmark measures.


@pytest.fixture(scope="module", autouse=True)
def without_update_flops():
  """``step_traffic.compile_step`` also compiles the optimizer update alone for its FLOPs
  column (a third of its time on these configs), which no test here reads: that second
  program is left out; the step's HLO, log and plan are the benchmark's."""
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(step_traffic, "update_flops", lambda tx, state: 0.0)
    yield


@pytest.fixture(scope="module")
def adamw_step():
  """adamw's step on lm_tp_fsdp (tiny): its wire bytes and compiled kernels."""
  hlo, _, _, _ = step_traffic.compile_step(config_with("lm_tp_fsdp", "adamw"))
  return traffic.wire_bytes(hlo), compile_time.kernels(hlo)


GOAL = {
    "kron:local": 1.10,
    "shampoo:local": 1.10,
    "kron": 1.25,
    "shampoo": 1.25,
    "muon": 1.25,
    "soap": 1.25,
}
# Measured on configs/lm_tp_fsdp.py (tiny), 2026-12-02. The default tiles miss their goal on
# this tiny model: its params have fewer tiles than the 8 devices, so every tile is pooled, and
# every pooled factor makes the round trip to its owner each step (the state is the same on any
# mesh, so no pool is stored as one: kron 1.32x and shampoo 1.99x while some were). On
# size=small kron met it (1.17x) and shampoo did not (1.67x): docs/optimizers.md says why.
# Shampoo 2.03x -> 1.93x when like params began to move to their pool as one (issue 34). SOAP
# pools Shampoo's tiles with two factors per dim (statistics and eigenbases): 2.27x. When the
# pools began to move one run of mesh axes at a time (no involuntary rematerialization on a
# ViT's ranks, pools.axis_steps), 2026-12-03: kron 1.34x -> 1.36x, shampoo 1.93x -> 1.91x,
# soap 2.27x -> 2.22x. Muon 1.21x -> 1.19x when its updates began to go back from their owners by
# all-to-all instead of an all-gather, -> 1.06x when the leftovers of several shapes did too
# (issue 34). Shampoo 1.91x -> 1.54x when its state stopped keeping the roots that every step
# refreshes (none move to the pools or back), -> 1.33x with the registry's blocks of 256
# (2026-12-05), -> 1.23x with its statistics stored packed (symmetric.py: half the bytes);
# SOAP's packed too: 2.22x -> 2.05x; Kron's triangular Qs packed: 1.36x -> 1.27x, -> 1.20x with
# its probes drawn tile by tile where the pool fits them (draws.py), not moved there. With a
# pooled param's tiles turned where they are taller than wide or it is split on its columns
# alone (blocked.turns, 2026-12-05: like tiles one pool, less padding, no move to the rows
# first): kron 1.20x -> 1.13x, shampoo 1.23x -> 1.14x, soap 2.05x -> 1.56x. Kron's shard-local
# blocks measured 1.01x (the never-sharded params' pieces). With the pools' arrays moved as each
# device's pieces of their tiles (pieces.py, 2026-12-06: a param cut on its own spec, split on
# its rows or its columns, joins its pool in one all-to-all): kron 1.12x, shampoo 1.13x, soap
# 1.54x; 1.52x with a pool's arrays and factors moved as one array each way. Shampoo 1.12x with
# its norm scales' pool riding in another pool's padding (pools.run_pools). SOAP 1.19x with its
# pools padded up to 1.5x keeping their state where they run (the registry's resident_padding,
# bv_sharding/optimizers/holding.py, 2026-12-06; 1.06x with every pool's); Kron 1.05x with its
# pools' Qs held so (the same day). Shampoo's pools holding their statistics and roots so
# (2026-12-07): 1.08x at update_preconditioners_freq=1; at its new default of 10, its roots kept
# and refreshed a group of tiles each step, 1.09x (1.27x with no pool held: the roots move to the
# pools every step). Muon with its embedding and head on Adam (adam_leaves, 2026-12-07): 1.098x
# (1.063x with every matrix orthogonalised, where they filled the MLP matrices' last round).
MEASURED = {
    "kron:local": 1.01,
    "shampoo:local": 1.00,
    "kron": 1.05,
    "shampoo": 1.09,
    "muon": 1.10,
    "soap": 1.19,
}
# A step that takes no lax.cond's true branch (traffic.wire_bytes(hlo, branch=0)): Kron's between
# its fits (most steps once its update probability decays), Shampoo's between root refreshes
# (every step refreshes at the registry's update_preconditioners_freq=1). Their pools move the
# probe, the fit's target and the Qs back, or the roots back, only on a fit or refresh
# (2026-12-03): kron 1.20x, meeting its goal on those steps; shampoo 1.73x (1.33x since every
# step refreshes, keeping no roots, and its blocks are 256: no step skips it, 2026-12-05; 1.23x
# with its statistics packed). SOAP's pools
# move its bases back only on a refresh or fit (2026-12-05): 2.22x -> 2.04x between them, 1.86x
# with its statistics packed; Kron's 1.15x with its Qs packed. Turned tiles: kron 1.10x, soap
# 1.46x. Arrays moved as pieces: kron 1.09x, shampoo 1.13x, soap 1.44x (1.42x moved as one).
# SOAP with its pools' state held where they run: 1.16x; Kron with its pools' Qs held: 1.05x.
# Shampoo at update_preconditioners_freq 10 (2026-12-07), its pools holding their roots: 1.08x
# (1.20x with none held). Each of its steps refreshes a group of tiles, so a period's mean is its
# whole step's 1.09x.
BETWEEN_FITS = {"kron": 1.05, "shampoo": 1.09, "soap": 1.16}
# What XLA's compile time grows with: the compiled step's kernels (distinct fused computations,
# compile_time.kernels) over adamw's, under the tests' compile flags (conftest.py's
# FAST_COMPILE), held as a regression bound; issue 34's goal is 2x of the compile time. Until
# 2026-12-06 this bound was on instructions (the last bounds: kron 1.92x,
# shampoo 1.71x, soap 2.38x, muon 1.24x, kron:local 2.28x, shampoo:local 1.61x); reading each
# like param's results at an index XLA cannot fold (pools.opaque_indices) adds instructions
# (2.01x, 1.80x, 2.49x) while it takes kernels away, and kernels are what XLA:CPU compiles one
# by one (about 20 ms each with its fusion emitters). Kernels then: kron 3.39x -> 3.17x,
# shampoo 2.65x -> 2.43x, soap 3.61x -> 3.43x, and muon 1.72x -> 1.64x when its owners' results
# were read so too. With each pool's arrays and factors moved as one array each way (pools._bundles:
# one all-to-all, not one per array, and XLA:CPU cuts each all-to-all into a kernel per device):
# kron 2.95x, shampoo 2.08x, soap 2.87x. The shard-local blocks still run one program per param
# (kron:local). With Kron's whole probes drawn apart (opaque.apart) and members read without
# jax's negative-index fix-up (2026-12-06): kron 2.82x (4.13x local), shampoo 1.95x, soap 2.86x;
# with Kron's key chain as one loop (kron._coin_and_keys): kron 2.70x (4.01x local); SOAP's
# pools holding their state where they run (no stack moved in or back): soap 2.36x; Kron's
# holding its Qs so: kron 2.45x. Shampoo's roots by the coupled Newton iteration (a loop of
# matmuls and a power iteration per tile shape, where eigh was one call, 2026-12-07): shampoo
# 1.95x -> 2.20x, shampoo:local 2.30x -> 2.89x. Kron's born Qs set from each tile's first
# momentum (a cond per stack, skipped once they are set; 2026-12-07): kron 2.62x (4.41x local).
# Shampoo at update_preconditioners_freq 10, in groups of tiles (each stack's due roots computed
# in a loop, gathered, under a cond; 2026-12-07): shampoo 2.26x (2.17x at freq 1),
# shampoo:local 2.89x. Kron's inverse unrolled (its loop's carry was copied each turn on a TPU) and
# its balance under a cond of its own (2026-12-07): kron 2.64x. Symmetric matrices packed by
# slices and masks instead of a gather (on a TPU v5e 11x faster to pack, 3x to unpack) and Kron's
# Qs kept packed through its conds, its probes drawn under the fit's cond (2026-12-07): kron
# 2.79x (4.68x local), shampoo 2.30x (2.95x local).
KERNELS = {
    "kron:local": 4.68,
    "shampoo:local": 2.95,
    "kron": 2.79,
    "shampoo": 2.30,
    "muon": 1.64,
    "soap": 2.36,
}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("optimizer", list(GOAL))
def test_second_order_step_compiles_without_remat_and_near_adamw_traffic(optimizer, adamw_step):
  hlo, log, _, _ = step_traffic.compile_step(config_with("lm_tp_fsdp", optimizer))
  assert step_traffic.REMAT not in log
  adamw_bytes, adamw_kernels = adamw_step
  size = compile_time.kernels(hlo) / adamw_kernels
  assert size <= KERNELS[optimizer] + 0.02, f"{optimizer}: {size:.2f}x adamw's kernels"
  ratio = traffic.wire_bytes(hlo) / adamw_bytes
  assert ratio <= MEASURED[optimizer] + 0.02, f"{optimizer}: {ratio:.3f}x adamw's bytes"
  between = traffic.wire_bytes(hlo, branch=0) / adamw_bytes
  assert between <= BETWEEN_FITS.get(optimizer, MEASURED[optimizer]) + 0.02, between
  assert ratio <= GOAL[optimizer] and between <= GOAL[optimizer], (ratio, between)


# Kron between its fits on configs/lm.py tiny (FSDP over 8): 1.38x (2026-12-03), above its goal;
# Shampoo's step there: 1.40x (2026-12-05, statistics packed); Kron's 1.29x with its Qs packed.
# Kron's fit step there, its probes drawn in the pools: 1.39x (2026-12-05). With turned tiles
# (2026-12-05): kron 1.252x (1.18x between fits), shampoo 1.263x. What is left there is the
# padding of a pool of 14 tiles of 128 x 256 to 16 slots, lm_head's move from its columns to
# its rows, and Shampoo's statistics of the 1-D norm scales, to their pool and back. With the
# pools' arrays moved as pieces (2026-12-06), lm_head joins its pool split on its columns, with
# no move to its rows: kron 1.246x (met), shampoo 1.258x. With the norm scales' pool riding in
# the padding of the pool of 14 tiles (pools.run_pools, 2026-12-06): shampoo 1.246x (met).


@pytest.mark.timeout(600)
def test_shampoo_refreshing_its_roots_where_its_pools_keep_them_moves_nothing_more(adamw_step):
  """Shampoo at its default (``update_preconditioners_freq`` 10, a group of tiles' roots new
  each step) with every pool keeping its statistics and roots where it runs
  (``shampoo:resident``): a step that refreshes moves what a step that does not moves (no
  root moves), 1.071x adamw's bytes on lm_tp_fsdp tiny (2026-12-07; with no pool held, 1.27x
  and 1.20x between refreshes), within the goal."""
  hlo, log, _, _ = step_traffic.compile_step(config_with("lm_tp_fsdp", "shampoo:resident"))
  assert step_traffic.REMAT not in log
  whole, between = traffic.wire_bytes(hlo), traffic.wire_bytes(hlo, branch=0)
  assert whole == between
  assert whole / adamw_step[0] <= min(1.07 + 0.02, GOAL["shampoo"]), whole / adamw_step[0]


@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    "spec, scan",
    [
        ("lm", False),
        ("lm:size=small", False),
        ("lm_tp_fsdp:size=small", False),
        ("lm_tp_fsdp:size=small", True),
        ("lm:size=small", True),
    ],
)
def test_muon_shampoo_kron_and_resident_soap_move_at_most_their_goal_on_each_config(spec, scan):
  """Muon's owners on configs/lm.py (FSDP) and lm_tp_fsdp.py (data x model), tiny and small
  (lm_tp_fsdp tiny above), and lm_tp_fsdp small with scanned layers: measured 1.10x, 1.11x,
  1.12x and 1.15x adamw's bytes (2026-12-03; an all-gather of the update took the small ones to
  1.49x and 1.35x, and gathering the leftovers of several shapes whole took them to 1.19x,
  1.15x, 1.23x and 1.2505x). Kron's step between its fits (``BETWEEN_FITS``), on the same
  configs: 1.20x on lm small and lm_tp_fsdp small (2026-12-03); lm tiny missed then. On
  lm small with scanned layers (2026-12-05): muon 1.19x, kron 1.13x between fits. There Kron's
  step printed "Involuntary full rematerialization" while the never-sharded params' blocks (the
  scanned norm scales) ran on global arrays, XLA choosing how to split their factor fit; they
  run in shard_map, whole on every device, since (1.34x -> 1.22x on a fit step, no remat).
  Shampoo's whole step (every step refreshes its roots), its statistics packed (2026-12-05):
  1.40x on lm tiny (a miss), 1.21x on lm small, 1.18x on lm_tp_fsdp small, and scanned 1.14x
  and 1.18x. Kron's whole step, a fit included, its probes drawn in the pools (2026-12-05):
  1.39x on lm tiny (a miss), 1.20x on lm small and lm_tp_fsdp small, scanned 1.13x and 1.17x.
  With a pooled param's tiles turned (``blocked.turns``, 2026-12-05, the tests' compile flags),
  kron / shampoo / muon: lm tiny 1.252x (a miss) / 1.263x (a miss) / 1.10x, lm small 1.17x /
  1.19x / 1.11x, lm_tp_fsdp small 1.20x / 1.18x / 1.12x, scanned lm small 1.13x / 1.14x /
  1.19x (1.15x / 1.16x before a stack of layers' matrices turned too) and lm_tp_fsdp small
  1.19x / 1.20x / 1.14x. With the pools' arrays moved as pieces (2026-12-06): lm tiny 1.246x
  (met) / 1.258x (a miss), lm_tp_fsdp small 1.16x / 1.14x, scanned 1.15x / 1.17x; lm small
  and its scanned variant as before. With Shampoo's small pools riding in bigger pools' padding
  (``pools.run_pools``, 2026-12-06): shampoo on lm tiny 1.246x (met), lm small 1.186x,
  lm_tp_fsdp small 1.140x, scanned 1.141x and 1.161x. SOAP with its pools' state kept where
  they run (``soap:resident``, 2026-12-06: only the gradient's and the direction's pieces
  move): 1.135x on lm tiny, 1.112x on lm small, 1.078x on lm_tp_fsdp small, scanned 1.085x and
  1.105x (its state moved to the pools and back each step: 1.97x, 1.82x, 1.68x). Muon with its
  embedding and head on Adam (2026-12-07): lm tiny 1.094x, lm small 1.105x, lm_tp_fsdp small
  1.167x, scanned 1.156x and lm small scanned 1.079x (every matrix orthogonalised: 1.100x,
  1.108x, 1.120x, 1.144x, 1.187x)."""
  wire = {}
  for optimizer in ("adamw", "muon", "kron", "shampoo", "soap:resident"):
    config = config_with(spec, optimizer)
    config.model.scan_layers = scan
    hlo, log, _, _ = step_traffic.compile_step(config)
    assert step_traffic.REMAT not in log
    wire[optimizer] = traffic.wire_bytes(hlo)
  for optimizer in ("muon", "kron", "shampoo"):
    assert wire[optimizer] / wire["adamw"] <= GOAL[optimizer], (optimizer, wire)
  assert wire["soap:resident"] / wire["adamw"] <= GOAL["soap"], wire


def test_xla_cpu_reduces_by_all_reduce_and_slice():
  """The backend fact behind the scanned step's extra third: asked for a reduce-scatter
  (partial sums to a sharded result), XLA:CPU all-reduces and slices (2 units, not 1)."""
  mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  rows = NamedSharding(mesh, P("data", None))
  x = jax.ShapeDtypeStruct((64, 256), jnp.float32, sharding=rows)
  hlo = jax.jit(lambda a, b: a.T @ b, out_shardings=rows).lower(x, x).compile().as_text()
  assert [c.op for c in traffic.collectives(hlo)] == ["all-reduce"]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("scan, axis_types", [(False, "auto"), (True, "auto"), (True, "explicit")])
def test_adamw_step_gathers_params_once_unscanned_scanned_layers_twice(scan, axis_types):
  """Unscanned, XLA keeps the gathered params from forward to backward; scanned, the
  backward loop gathers the layers' params again (keeping them would hold every layer
  whole). On Explicit axes the scanned body gathers each layer where it reads it and the
  backward pass gathers it again (``bvs.save_anything_but_gathers``), as XLA does on Auto
  ones. Grads are all-reduced either way (2 units on XLA:CPU, see above)."""
  config = config_with("lm", "adamw")
  config.model.scan_layers = scan
  config.mesh_axis_types = axis_types
  hlo, log, _, (_, plan, _) = step_traffic.compile_step(config)
  assert step_traffic.REMAT not in log
  params = [e for e in plan.entries if e.name.startswith("params/")]
  layers = sum(e.nbytes for e in params if e.name.startswith("params/layers/"))
  scanned = layers / sum(e.nbytes for e in params) if scan else 0.0
  assert step_traffic.in_param_units(hlo, plan) == pytest.approx((1 + scanned, 2.0), abs=0.01)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("spec", ["lm_tp_fsdp", "lm_tp_fsdp:size=small"])
def test_explicit_axes_step_moves_what_the_auto_step_moves(spec):
  """configs/lm_tp_fsdp.py's step on Explicit axes (tiny and small): the params gathered in
  the loss, the activations resharded, lm_head's kernel gathered over "model" rather than
  the logits; within 5% of the Auto step's bytes (1.7% and 0.6% more in fact)."""
  wire = {}
  for axis_types in ("auto", "explicit"):
    config = config_with(spec, "adamw")
    config.mesh_axis_types = axis_types
    hlo, log, _, _ = step_traffic.compile_step(config)
    assert step_traffic.REMAT not in log
    wire[axis_types] = traffic.wire_bytes(hlo)
  assert wire["explicit"] == pytest.approx(wire["auto"], rel=0.05)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("optimizer", ["kron", "soap"])
def test_the_step_cpu_devices_run_holds_no_collective_under_a_cond(optimizer):
  """The trainer's step as it runs on CPU devices (not as ``step_traffic`` compiles it for an
  accelerator): no collective under a ``lax.cond``, which XLA:CPU's devices could take in
  different orders (``gating.skips_here``)."""
  config = config_with("lm", optimizer)
  mesh = bvs.make_mesh(config.mesh, axis_types=build.axis_types(config))
  hlo = build.compile_step(build.build(config, mesh)).train.as_text()
  assert [c for c in traffic.collectives(hlo) if c.branches] == []
