"""Optimizer state follows its params: every optimizer, one strategy, sharded steps match one device."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import bv_sharding as bvs
from benchmarks import zoo
from benchmarks.shapes import llama_params, sds
from bv_sharding.specs import MiB

MESHES = {"4x2": [("data", 4), ("model", 2)], "8x1": [("data", 8), ("model", 1)]}
STRATEGY = [(".*", 'tensor_parallel(axis="model")|fsdp(axis="data", min_size_to_shard_mb=0)')]
CASES = [(name, mesh, False) for name in zoo.optimizers(llama_params()) for mesh in MESHES]
CASES += [(name, mesh, True) for name in ("psgd_kron", "kron", "kron_blocks") for mesh in MESHES]
# precondition-opt's distributed_shampoo computes its roots in float64 where jax_enable_x64 is
# on, else in float32 (its comment says so) after jax's warning, which is not ours to fix.
FLOAT32_ROOTS = pytest.mark.filterwarnings("ignore:Explicitly requested dtype float64:UserWarning")


def problem(name: str, scanned: bool) -> dict:
  """The Llama params ``name`` steps on. distributed_shampoo's sharded step compiles for
  minutes per param on 2 cores (130-200 s for the whole tree), so it gets one param of each
  kind: the embedding (fsdp), a tensor-parallel kernel and a norm scale."""
  shapes = llama_params(layers=2 if scanned else None)
  if name != "distributed_shampoo":
    return shapes
  block = shapes["block"]
  return {
      "embed": shapes["embed"],
      "block": {
          "mlp": {"down_kernel": block["mlp"]["down_kernel"]},
          "attn_norm": block["attn_norm"],
      },
  }


def random_like(shapes, seed):
  leaves, treedef = jax.tree.flatten(shapes)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  return treedef.unflatten(
      [jax.random.normal(k, x.shape, x.dtype) * 0.1 for k, x in zip(keys, leaves)]
  )


def make_step(tx):
  def step(params, opt, grads):
    updates, opt = tx.update(grads, opt, params)
    return optax.apply_updates(params, updates), opt

  return step


def relative_errors(tree, reference):
  """Per-leaf relative error. distributed_shampoo's ``training_metrics`` are skipped: they are
  residuals of its root solver (~1e-6), so their relative error is rounding noise of O(1)
  whenever the reduction order changes, and they feed nothing back into the update."""
  errors = {}
  for (name, a), (_, b) in zip(
      bvs.ops.flatten_with_names(tree)[0], bvs.ops.flatten_with_names(reference)[0]
  ):
    if "training_metrics" in name.split("/"):
      continue
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    errors[name] = np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30) if b.size else 0.0
  return errors


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "name, mesh_name, scanned",
    [
        pytest.param(
            n,
            m,
            s,
            id=f"{n}-{m}{'-scanned' if s else ''}",
            marks=[FLOAT32_ROOTS] if n == "distributed_shampoo" else [],
        )
        for n, m, s in CASES
    ],
)
def test_state_is_born_sharded_stays_sharded_and_matches_one_device(name, mesh_name, scanned):
  mesh = bvs.make_mesh(MESHES[mesh_name])
  shapes = problem(name, scanned)
  tx = zoo.optimizers(shapes, scanned=scanned)[name]
  plan = bvs.plan({"params": shapes, "opt": jax.eval_shape(tx.init, shapes)}, STRATEGY, mesh)
  psh, osh = plan.shardings["params"], plan.shardings["opt"]

  params = jax.jit(lambda: random_like(shapes, 0), out_shardings=psh)()
  opt = jax.jit(tx.init, out_shardings=osh)(params)
  assert plan.mismatches({"params": params, "opt": opt}) == []
  assert any(e.sharded for e in plan.entries if e.follows), "no state leaf was sharded"

  sharded_step = jax.jit(make_step(tx), in_shardings=(psh, osh, psh), out_shardings=(psh, osh))
  single_step = jax.jit(make_step(tx))
  one = jax.devices()[0]
  params1, opt1 = jax.device_put((params, opt), one)
  for k in range(3):
    grads = random_like(shapes, k + 1)
    params, opt = sharded_step(params, opt, jax.device_put(grads, psh))
    assert plan.mismatches({"params": params, "opt": opt}) == [], f"step {k}"
    params1, opt1 = single_step(params1, opt1, jax.device_put(grads, one))
  errors = relative_errors({"params": params, "opt": opt}, {"params": params1, "opt": opt1})
  worst = max(errors, key=errors.get)
  assert errors[worst] <= 1e-5, (worst, errors[worst])


@pytest.mark.parametrize("name", list(zoo.optimizers(llama_params())))
def test_every_state_leaf_over_1mib_is_sharded_with_big_vision_fsdp(name):
  shapes = llama_params(d=512, vocab=8192, ff=2048)
  tx = zoo.optimizers(shapes)[name]
  mesh = bvs.make_abstract_mesh([("data", -1)], 8)
  plan = bvs.plan(
      {"params": shapes, "opt": jax.eval_shape(tx.init, shapes)},
      [(".*", 'fsdp(axis="data")')],
      mesh,
  )
  # big_vision's fsdp leaves a param of exactly its 4 MiB threshold unsharded; state never is.
  at_threshold = lambda e: e.name.startswith("params/") and e.nbytes == 4 * MiB
  stranded = [
      (e.name, e.shape, e.why) for e in plan.unsharded(min_bytes=MiB + 1) if not at_threshold(e)
  ]
  assert stranded == []


def plan_state(
    params,
    state,
    strategy=(".*", 'fsdp(axis="data", min_size_to_shard_mb=0)'),
    mesh=(("data", 4), ("model", 2)),
):
  strategy = [strategy] if isinstance(strategy, tuple) else strategy
  p = bvs.plan({"params": params, "opt": state}, strategy, bvs.make_abstract_mesh(mesh, 8))
  return p.by_name()


def test_same_shape_state_gets_the_param_spec_and_why_names_the_param():
  params = {"w": sds(64, 256)}
  entries = plan_state(params, jax.eval_shape(optax.adam(LR := 1e-3).init, params))
  del LR
  assert entries["params/w"].spec == P(None, "data")
  mu = entries["opt/0/mu/w"]
  assert mu.spec == P(None, "data") and mu.follows == "params/w"
  assert "follows params/w (same shape)" in mu.why


def test_adafactor_factors_keep_the_axes_of_the_dims_they_keep():
  params = {"w": sds(512, 1024)}
  state = jax.eval_shape(optax.adafactor(1e-3).init, params)
  entries = plan_state(
      params, state, (".*", 'shard_dim(axis="data", dim=0)|' 'shard_dim(axis="model", dim=1)')
  )
  assert entries["params/w"].spec == P("data", "model")
  assert entries["opt/0/v_row/w"].spec == P("data")
  assert entries["opt/0/v_col/w"].spec == P("model")
  assert "declared by FactoredState" in entries["opt/0/v_row/w"].why


def kron_state(shapes):
  return {"Qs_preconditioners": {n: [sds(*q) for q in qs] for n, qs in shapes.items()}}


def test_kron_factors_take_their_param_dims_axis_on_columns_including_square_and_scanned():
  params = {"rect": sds(256, 64), "square": sds(64, 64), "scan": sds(4, 64, 128), "vec": sds(128)}
  state = kron_state(
      {
          "rect": [(256, 256), (64, 64)],
          "square": [(64, 64), (64, 64)],
          "scan": [(4, 64, 64), (4, 128, 128)],
          "vec": [(128,)],
      }
  )
  entries = plan_state(
      params,
      state,
      [(".*", 'shard_dim("data", -2, ignore_ndim_error=True)|shard_dim(axis="model", dim=-1)')],
  )
  assert entries["params/square"].spec == P("data", "model")
  assert entries["opt/Qs_preconditioners/rect/0"].spec == P(None, "data")
  assert entries["opt/Qs_preconditioners/rect/1"].spec == P(None, "model")
  assert entries["opt/Qs_preconditioners/square/0"].spec == P(None, "data")
  assert entries["opt/Qs_preconditioners/square/1"].spec == P(None, "model")
  assert "factor of dim 1" in entries["opt/Qs_preconditioners/square/1"].why
  assert entries["params/scan"].spec == P(None, "data", "model")
  assert entries["opt/Qs_preconditioners/scan/0"].spec == P(None, None, "data")
  assert entries["opt/Qs_preconditioners/scan/1"].spec == P(None, None, "model")
  assert entries["params/vec"].spec == P("model")  # dim -2 is out of range for 1-d
  assert entries["opt/Qs_preconditioners/vec/0"].spec == P("model")


def test_preconditioner_op_overrides_the_factor_dim():
  params = {"w": sds(256, 64)}
  state = kron_state({"w": [(256, 256), (64, 64)]})
  entries = plan_state(
      params,
      state,
      [
          (".*Qs_preconditioners.*", "preconditioner(dim=0)"),
          (".*", 'fsdp(axis="data", min_size_to_shard_mb=0)'),
      ],
  )
  assert entries["params/w"].spec == P("data", None)
  assert entries["opt/Qs_preconditioners/w/0"].spec == P("data", None)
  assert entries["opt/Qs_preconditioners/w/1"].spec == P("data", None)  # the param's axis
  assert "preconditioner: dim 0 over data" in entries["opt/Qs_preconditioners/w/0"].why


def test_shampoo_block_stacks_follow_the_params_axes_on_the_block_batch_dim():
  params = {"w": sds(512, 1024)}
  state = {
      "w": {"stats": [sds(32, 128, 128), sds(32, 128, 128)], "roots": [sds(32, 128, 128)]},
      "blocks": {"w": [sds(128, 128)] * 2},
  }
  entries = plan_state(params, state, (".*", 'fsdp(axis="data", min_size_to_shard_mb=1)'))
  stats = entries["opt/w/stats/0"]
  assert stats.spec == P("data", None, None) and "block stack" in stats.why
  assert entries["opt/blocks/w/0"].spec == P(None, None)  # 64 KiB: under the threshold


def test_following_never_strands_a_big_factor_of_a_small_param():
  params = {"w": sds(4096, 8)}
  state = kron_state({"w": [(4096, 4096), (8, 8)]})
  entries = plan_state(params, state, (".*", 'fsdp(axis="data")'))
  assert entries["params/w"].spec == P(None, None)  # 128 KiB: under fsdp's 4 MiB
  big = entries["opt/Qs_preconditioners/w/0"]
  assert big.spec in (P("data", None), P(None, "data")) and "fallback (>= 4 MiB)" in big.why


def test_replicate_still_replicates_state_and_zero1_shards_only_state():
  params = {"w": sds(512, 1024)}
  state = jax.eval_shape(optax.adam(1e-3).init, params)
  entries = plan_state(params, state, [("opt/.*", "replicate()"), (".*", 'fsdp(axis="data")')])
  assert entries["opt/0/mu/w"].spec == P(None, None)
  entries = plan_state(params, state, (".*", 'zero1(axis="data")'))
  assert entries["params/w"].spec == P(None, None)
  assert entries["opt/0/mu/w"].spec == P(None, "data")


def test_unclaimed_state_follows_by_default_and_orphans_are_replicated_and_reported():
  params = {"w": sds(512, 1024)}
  state = {"mu": {"w": sds(512, 1024)}, "orphan": sds(1024, 1024), "count": jnp.zeros(())}
  entries = plan_state(params, state, [("params/.*", 'fsdp(axis="data")')])
  assert entries["opt/mu/w"].spec == P(None, "data") and "default" in entries["opt/mu/w"].why
  assert entries["opt/orphan"].spec == P(None, None)
  assert "no param to follow" in entries["opt/orphan"].why
  assert entries["opt/count"].spec == P() and "scalar" in entries["opt/count"].why


def test_state_inside_flax_struct_dataclasses_and_masked_states():
  import flax.struct

  @flax.struct.dataclass
  class Inner:
    trace: dict
    steps: jax.Array

  params = {"w": sds(512, 1024), "b": sds(1024)}
  masked = jax.eval_shape(optax.masked(optax.adam(1e-3), {"w": True, "b": False}).init, params)
  state = {"inner": Inner({"w": sds(512, 1024)}, sds()), "masked": masked, "empty": []}
  entries = plan_state(params, state, (".*", 'fsdp(axis="data", min_size_to_shard_mb=1)'))
  assert entries["opt/inner/trace/w"].spec == P(None, "data")
  assert entries["opt/masked/inner_state/0/mu/w"].spec == P(None, "data")
  assert entries["opt/masked/inner_state/0/mu/w"].follows == "params/w"
