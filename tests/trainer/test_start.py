"""trainers/start.py's policy, through `python -m trainers.train` on real checkpoints: a
resume onto other meshes, dtypes and optimizers (the optimizer state kept, moved or born
afresh with what carries over, its schedule continuing), and `config.model_init`. Each starts
from a copy of the uninterrupted reference run's checkpoints (``runs.reference``).
"""

import dataclasses
import functools
import json
import pathlib
import shutil

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import bv_sharding as bvs
from benchmarks.optimizer_change import jump
from bv_sharding.optimizers import rebirth
from configs import lm
from tests.helpers import made_once, metrics
from tests.trainer import runs
from tests.trainer.runs import (
    STEPS,
    copy_at,
    finish,
    lm_in,
    saved,
    start,
    train,
)
from trainers import build, models, optimizers, steps
from trainers.rundir import checkpoint
from trainers.start import Start, restore, restore_or_init


def equal_on_host(a, b) -> bool:
  """Whether trees ``a`` and ``b`` hold equal leaves, compared as host arrays. Compared on the
  devices (``jnp.array_equal`` per leaf: one small 8-device program a leaf, each reducing
  across the devices, dispatched back to back) XLA:CPU aborted the worker on a loaded host: a
  core's backtrace ends in ``InProcessCommunicator::AllReduce`` -> ``AwaitAndLogIfStuck``, a
  collective whose 8 participants did not all arrive before its termination timeout."""
  return all(jax.tree.leaves(jax.tree.map(np.array_equal, jax.device_get(a), jax.device_get(b))))


def test_a_workdir_starts_fresh_then_from_its_checkpoint_and_another_from_its_model_init(
    tmp_path,
):
  """The policy's order, in this process: no checkpoint and no ``config.model_init``: a fresh
  init at step 0; a checkpoint: its state; ``config.model_init`` in a new workdir: its params
  with a fresh optimizer state, at step 0."""
  run = lm_in("float32")
  adamw = optimizers.BuiltOptimizer("adamw", {})
  with jax.set_mesh(run.mesh), nn.logical_axis_rules(run.config.sharding_rules):
    ckpt = checkpoint.Checkpoints(str(tmp_path / "first"), run.config, adamw, run.plan)
    state, begun = restore_or_init(ckpt, run)
    assert begun == Start(0, "scratch") and ckpt.step == 0
    state["params"] = jax.tree.map(lambda x: x + 1, state["params"])
    ckpt.close(state)  # Saves step 0.
    ckpt = checkpoint.Checkpoints(str(tmp_path / "first"), run.config, adamw, run.plan)
    restored, begun = restore_or_init(ckpt, run)
    assert begun == Start(0, str(tmp_path / "first" / "checkpoints" / "0"))
    assert equal_on_host(restored, state)
    ckpt.manager.close()
    run = dataclasses.replace(
        run, config=dataclasses.replace(run.config, model_init=str(tmp_path / "first"))
    )
    ckpt = checkpoint.Checkpoints(str(tmp_path / "second"), run.config, adamw, run.plan)
    loaded, begun = restore_or_init(ckpt, run)
    assert begun == Start(0, str(tmp_path / "first" / "checkpoints" / "0"))
    assert equal_on_host(loaded["params"], state["params"])
    fresh = steps.init_opt(run.tx, run.plan, loaded["params"])
    assert equal_on_host(loaded["opt"], fresh)
    ckpt.manager.close()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  return runs.reference(tmp_path_factory)


def tiny_lm(optax_name="adamw", ramp=True):
  """The model and optimizer of ``runs.CONFIG``, for restoring in this process; ``ramp``: the
  chain ends with the ramp, as the trainer's does (``rebirth.ramped``)."""
  model = models.from_config(lm.get_config("layers=1"))
  init = lambda: model.init(jax.random.key(0), np.zeros((1, 32), np.int32))["params"]
  schedule = {"warmup_steps": 2, "decay_type": "cosine", "total_steps": STEPS}
  tx = optimizers.make_optimizer(
      optax_name, 3e-3, schedule=schedule, weight_decay=1e-4, clip_norm=1.0
  )
  return init, rebirth.ramped(tx, 5) if ramp else tx


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "mesh", [[("data", 8)], [("data", 4), ("model", 2)], [("data", 2)], [("data", 1)]]
)
def test_restored_values_are_exact_in_the_new_plans_shardings(reference, mesh):
  init, tx = tiny_lm()
  devices = np.prod([n for _, n in mesh])
  mesh = bvs.make_mesh(mesh, devices=jax.devices()[:devices])
  strategy = [(".*", 'llm_fsdp(axis="data", min_size_to_shard_mb=0)')]
  plan = bvs.plan(steps.abstract_state(init, tx), strategy, mesh)
  manager = checkpoint.open_manager(str(reference / "checkpoints"), read_only=True)
  adamw = optimizers.BuiltOptimizer("adamw", plan.abstract()["params"])
  state, begun = restore(manager, STEPS, plan, tx, adamw)
  assert begun.step == STEPS and plan.mismatches(state) == []
  want = {"params": saved(reference, STEPS), "opt": saved(reference, STEPS, "opt")}
  got = checkpoint.leaf_table(state)
  assert got == checkpoint.leaf_table(want)
  flat_got = dict(zip(got, jax.tree.leaves(state)))
  flat_want = dict(zip(checkpoint.leaf_table(want), jax.tree.leaves(want)))
  assert all(np.array_equal(np.asarray(flat_got[k]), flat_want[k]) for k in flat_want)


@pytest.mark.timeout(600)
def test_a_state_saved_before_the_ramp_resumes_as_saved(tmp_path, reference):
  """A checkpoint written before the trainer's chain ended with a ramp (its state the chain's
  alone): restored by a run whose chain has it, the state is kept as saved (not reborn as a
  foreign optimizer's), the ramp appended saturated (the updates as the run's own)."""
  ramped, unramped = (steps.abstract_state(*tiny_lm(ramp=r)) for r in (True, False))
  strategy = [(".*", 'llm_fsdp(axis="data", min_size_to_shard_mb=0)')]
  mesh = bvs.make_mesh([("data", 8)])
  plans = [bvs.plan(tree, strategy, mesh) for tree in (ramped, unramped)]
  adamw = optimizers.BuiltOptimizer("adamw", plans[0].abstract()["params"])
  manager = checkpoint.open_manager(str(reference / "checkpoints"), read_only=True)
  state, _ = restore(manager, STEPS, plans[0], tiny_lm()[1], adamw)
  state["opt"] = rebirth.unramped(state["opt"])  # As the code before the ramp saved it.
  ckpt = checkpoint.Checkpoints(str(tmp_path / "old"), lm_in("float32").config, adamw, plans[1])
  ckpt.begin(STEPS)
  ckpt.close(state)
  old = checkpoint.open_manager(str(tmp_path / "old" / "checkpoints"), read_only=True)
  restored, begun = restore(old, STEPS, plans[0], tiny_lm()[1], adamw)
  assert begun == Start(STEPS, str(tmp_path / "old" / "checkpoints" / str(STEPS)), 0)
  assert equal_on_host(rebirth.unramped(restored["opt"]), state["opt"])
  assert int(restored["opt"][-1].count) == rebirth.FULL and not plans[0].mismatches(restored)


def assert_restores_cast(workdir, step: int, dtype: str) -> None:
  """The checkpoint at ``step`` restored onto the plan of ``lm_in(dtype)``: every saved array
  cast to the plan's dtype (floats) or as saved, in the plan's shardings."""
  run = lm_in(dtype)
  manager = checkpoint.open_manager(str(workdir / "checkpoints"), read_only=True)
  state, begun = restore(manager, step, run.plan, run.tx, run.migration)
  assert begun.step == step and run.plan.mismatches(state) == []
  want = {"params": saved(workdir, step), "opt": saved(workdir, step, "opt")}
  for got, before, target in zip(*map(jax.tree.leaves, (state, want, run.plan.abstract()))):
    assert got.dtype == target.dtype
    assert np.array_equal(np.asarray(got), np.asarray(before).astype(target.dtype))


@pytest.mark.timeout(600)
def test_resume_in_other_dtypes_casts_the_saved_state(tmp_path, reference):
  """A float32 checkpoint resumed with bfloat16 params and state (and back): the saved values
  cast, the run continuing from the saved step with its optimizer state, the casts logged."""
  workdir = copy_at(reference, tmp_path / "run", STEPS)
  out = train(workdir, "--config.param_dtype=bfloat16", "--config.state_dtype=bfloat16", total=9)
  abstract = lm_in("bfloat16").plan.abstract()
  leaves = lambda tree: sum(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(tree))
  note = (
      f"restored params cast float32 -> bfloat16 ({leaves(abstract['params'])} leaves); "
      f"opt state cast float32 -> bfloat16 ({leaves(abstract['opt'])} leaves)"
  )
  assert note in out, out[-3000:]
  assert f"resumed at step {STEPS} from {workdir}/checkpoints/{STEPS} with its optimizer" in out
  assert [r["step"] for r in metrics(workdir)] == list(range(1, STEPS + 2))
  assert metrics(workdir)[-1]["loss"] < metrics(reference)[0]["loss"] - 1.0
  assert_restores_cast(reference, STEPS, "bfloat16")
  assert {x.dtype for x in jax.tree.leaves(saved(workdir, STEPS + 1))} == {jnp.dtype("bfloat16")}
  assert_restores_cast(workdir, STEPS + 1, "float32")


@pytest.mark.timeout(1500)
def test_resume_with_other_optimizers_adamw_kron_shampoo(tmp_path, reference):
  workdir = copy_at(reference, tmp_path / "run", STEPS)
  evals = [metrics(reference)[-1]["eval_loss"]]
  for before, name, total in (("adamw", "kron", STEPS + 4), ("kron", "shampoo", STEPS + 8)):
    # Kron's and Shampoo's train steps take minutes to compile on a loaded 2-core host.
    out = train(
        workdir,
        f"--config.optax_name={name}",
        "--config.schedule.warmup_steps=3",
        total=total,
        timeout=700,
    )
    assert f"resumed at step {total - 4} from" in out, out[-3000:]
    assert (
        f"optimizer state re-initialised (config.optax_name changed from {before!r} to {name!r})"
        in out
    )
    assert (
        "state shardings match the plan after restore" in out
    )  # The new state, born from the plan.
    assert "state shardings match the plan after the first step" in out
    records = metrics(workdir)
    assert [r["step"] for r in records] == list(range(1, total + 1))
    # The schedule continues at the global step, ramped in (rewarmup_steps 5: 0, then 1/5).
    assert records[-4]["lr"] == 0.0 and records[-3]["lr"] > 0.0
    evals.append(records[-1]["eval_loss"])
  assert evals[0] > evals[1] > evals[2], evals
  configs = [json.loads((workdir / "starts" / i / "config.json").read_text()) for i in "012"]
  assert [c["optax_name"] for c in configs] == ["adamw", "kron", "shampoo"]
  assert json.loads((workdir / "config.json").read_text())["optax_name"] == "adamw"


@pytest.mark.timeout(900)
def test_optimizer_change_continues_the_schedule_and_carries_the_moment(tmp_path):
  workdir, cosine = tmp_path / "run", ("--config.schedule.decay_type=cosine",)
  train(workdir, "--config.ckpt_steps=10", *cosine, total=20)
  new = ("--config.optax_name=kron", "--config.rewarmup_steps=4", *cosine)
  out = train(workdir, *new, total=40, timeout=700)
  # Adam's first moment and count, now Kron's, under the same names (the ramp's state last).
  assert "carried over: opt/1/0/mu/embed/embedding -> opt/1/0/mu/embed/embedding," in out
  assert "opt/1/0/mu/lm_head/kernel -> opt/1/0/mu/lm_head/kernel" in out
  assert "opt/1/0/count -> opt/1/0/count" in out
  peak = lm.get_config().lr * optimizers.registry.lr_scale("kron")
  schedule = optimizers.make_schedule(peak, 40, warmup_steps=2, decay_type="cosine")
  logged = {r["step"]: r["lr"] for r in metrics(workdir)}
  want = {s: float(schedule(s - 1)) * min(1.0, (s - 21) / 4) for s in range(21, 41)}
  assert {s: logged[s] for s in want} == pytest.approx(want, rel=1e-6)
  assert logged[40] < 0.01 * peak  # The cosine ends at total_steps.
  counts = {
      jax.tree_util.keystr(path, simple=True, separator="/"): int(x)
      for path, x in jax.tree_util.tree_flatten_with_path(saved(workdir, 40, "opt"))[0]
      if x.ndim == 0 and x.dtype.kind == "i"
  }
  # Applied: the schedule counted global steps, the ramp Kron's 20, Kron's count Adam's 20 too.
  assert counts == {"1/0/count": 40, "1/0/update_counter": counts["1/0/update_counter"]} | {
      "1/2/count": 40,
      "2/count": 20,
  }


CHANGE = ("--config.eval_every=1", "--config.ckpt_steps=20")


@pytest.fixture(scope="module")
def first_20_steps(tmp_path_factory):
  """optax_name -> a workdir holding its first 20 steps under ``CHANGE``, run once in the
  session (a test continues a copy of it)."""

  def run(optax_name: str) -> pathlib.Path:
    flags = (f"--config.optax_name={optax_name}", *CHANGE)
    make = lambda workdir: train(workdir, *flags, total=20, timeout=600)
    return made_once(tmp_path_factory, f"first-20-{optax_name}", make)

  return run


AFRESH = "born afresh: opt/1/0/count, opt/1/0/mu/*, opt/1/0/nu/*"


@pytest.mark.timeout(700)
@pytest.mark.parametrize(
    ("before", "after", "logged"),
    [
        ("kron", "adamw", AFRESH),
        ("adafactor", "adamw", AFRESH),
        ("soap", "adamw", AFRESH),
        # adamw's first 20 steps made once for the five changes from it (made_once).
        ("adamw", "lamb", "opt/1/0/count -> opt/1/0/count; born afresh: nothing"),
        ("adamw", "sgd", "opt/1/0/mu/embed/embedding -> opt/2/0/trace/embed/embedding"),
        ("adamw", "soap", "born afresh: opt/1/0/count (at 1: SOAP fits its bases on its first"),
        ("adamw", "shampoo", "opt/1/0/mu/embed/embedding -> opt/1/0/per_param/embed/embedding/"),
        ("lamb", "adamw", "opt/1/0/count -> opt/1/0/count; born afresh: nothing"),
        ("muon", "shampoo", "/momentum; born afresh: opt/1/0/count,"),
        ("adamw", "muon", "opt/1/0/count -> opt/1/inner_states/muon/inner_state/0/count;"),
    ],
)
def test_optimizer_changes_at_step_20_of_40_do_not_raise_the_loss(
    tmp_path, first_20_steps, before, after, logged
):
  """The new optimizer's moments and counts consistent (bv_sharding/optimizers/rebirth.py) and
  its updates ramped in over ``config.rewarmup_steps`` (default 5; the lr logged at step 21 is
  0): no eval loss after the change above the step-20 one + 0.1, and the train loss's jump
  (its highest at steps 21..25 minus its mean at 16..20) at most 0.5. kron -> adamw, when Kron's
  count corrected Adam's zero nu, logged a train loss of 23.8 at step 22 (5.4 at step 20). The
  eval loss (the same held-out batch at every step) is the stricter yardstick: the train
  batches' own difficulty moves their loss by up to 0.35 (an unchanged adamw run: 3.10 at 20,
  3.41 at 23). Without the ramp, adafactor -> adamw and soap -> adamw (Adam born afresh, its
  first steps sign-like at the full lr) rose to eval losses of 4.95 and 3.38 from 3.53 and 2.80,
  adamw -> soap (SOAP's lr twice adamw's) to 2.95 from 2.68. adamw -> sgd: SGD's trace born
  from Adam's mu. adamw -> soap: SOAP moves from its first step (a fresh run's first step only
  fits its bases), its mu refilled. adamw -> muon: Adam's count carried into Muon's and its
  inner Adam's, each its own copy (one array in both failed the first step: "Attempt to donate
  the same buffer twice", then a segfault)."""
  workdir = shutil.copytree(first_20_steps(before), tmp_path / "run")
  out = train(workdir, f"--config.optax_name={after}", *CHANGE, total=40, timeout=600)
  assert logged in out, out[-3000:]
  records = metrics(workdir)
  assert [r["step"] for r in records] == list(range(1, 41))
  assert all(np.isfinite(r["loss"]) for r in records) and records[20]["lr"] == 0.0
  limit = records[19]["eval_loss"] + 0.1
  assert max(r["eval_loss"] for r in records[20:]) <= limit, (before, after, records[19:])
  assert jump([r["loss"] for r in records], 20, 5) <= 0.5, (before, after, records[15:25])


@pytest.mark.timeout(600)
def test_model_init_loads_params_onto_another_mesh(tmp_path, reference):
  workdir = tmp_path / "finetune"
  out = train(
      workdir,
      f"--config.model_init={reference}",
      "--devices_per_process=2",
      "--config.schedule.warmup_steps=1",
      total=2,
  )
  assert f"params from config.model_init={reference}: {reference}/checkpoints/{STEPS};" in out, out[
      -3000:
  ]
  assert "state shardings match the plan after restore" in out
  first = metrics(workdir)[0]
  assert first["step"] == 1 and first["loss"] < metrics(reference)[0]["loss"] - 1.0
  assert json.loads((workdir / "starts" / "0" / "start.json").read_text())["start_step"] == 0


@pytest.mark.timeout(300)
def test_model_init_without_a_checkpoint_fails_before_training(tmp_path):
  status, out = finish(start(tmp_path / "run", f"--config.model_init={tmp_path}/nothing"))
  assert status != 0 and "ConfigError" in out
  assert f"config.model_init={tmp_path}/nothing: no complete checkpoint at" in out, out[-3000:]
  assert not (tmp_path / "run" / "metrics.jsonl").exists()


@functools.cache
def blocked_lm(optax_name: str, block_size: int, devices: int) -> build.Run:
  """``runs.CONFIG`` (a one-layer tiny Llama) with ``optax_name`` on ``devices``, built as the
  trainer builds it."""
  config = lm.get_config("layers=1")
  config.optax_name, config.optax, config.total_steps = optax_name, {"block_size": block_size}, 8
  config.schedule.warmup_steps = 2
  return build.build(config, bvs.make_mesh([("data", devices)], devices=jax.devices()[:devices]))


def assert_state_as_saved_after_restore(workdir, optax_name, block_size, devices, step):
  """The checkpoint written on 8 devices, restored onto ``devices``: every leaf as saved (the
  state is the same on any mesh), in this run's plan, some of them block stacks."""
  run = blocked_lm(optax_name, block_size, devices)
  manager = checkpoint.open_manager(str(workdir / "checkpoints"), read_only=True)
  state, _ = restore(manager, step, run.plan, run.tx, run.migration)
  assert not run.plan.mismatches(state)
  for got, want in zip(jax.tree.leaves(state["opt"]), jax.tree.leaves(saved(workdir, step, "opt"))):
    assert np.array_equal(np.asarray(got), want)
  stacks = jax.tree.leaves(state["opt"], is_leaf=lambda x: isinstance(x, optimizers.Stacks))
  assert any(isinstance(x, optimizers.Stacks) for x in stacks)


@pytest.mark.timeout(1800)
@pytest.mark.parametrize(
    "optax_name,block_size,devices,how",
    [("kron", 8, 2, "kept"), ("shampoo", 1024, 4, "re-initialised")],
)
def test_block_stacks_restore_onto_fewer_devices(tmp_path, optax_name, block_size, devices, how):
  """8 devices -> fewer: 8x8 tiles stay the same tiles (the state kept as saved); Shampoo's
  shard-local blocks ("local") of 1024 are each device's whole shard, other blocks on fewer
  devices (state re-initialised)."""
  workdir = tmp_path / "run"
  run = [f"--config.optax_name={optax_name}", f"--config.optax.block_size={block_size}"]
  run += ["--config.optax.blocking=local"] if how == "re-initialised" else []
  # Kron's and Shampoo's train steps take minutes to compile on a loaded 2-core host.
  train(workdir, *run, total=4, timeout=900)
  out = train(workdir, *run, f"--devices_per_process={devices}", total=6, timeout=900)
  assert "resumed at step 4 from" in out, out[-3000:]
  if how == "kept":
    assert "restored on mesh {'data': 2} as saved" in out and "re-initialised" not in out, out
    assert_state_as_saved_after_restore(workdir, optax_name, block_size, devices, 4)
  else:
    assert "optimizer state re-initialised (its blocks differ on this mesh: opt/" in out
  losses = [r["loss"] for r in metrics(workdir)]
  assert len(losses) == 6 and np.isfinite(losses).all() and losses[-1] < losses[0], losses
