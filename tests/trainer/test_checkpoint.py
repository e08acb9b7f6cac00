"""Durable runs through `python -m trainers.train`, with real orbax checkpoints on disk.

One uninterrupted 8-step run (`reference`, module-scoped) is the yardstick: runs
killed with SIGKILL (at a random step, and during a checkpoint write) or stopped
with SIGTERM, then started again on the same workdir, must log the same losses
and end with the same params, bit for bit. Restores onto other meshes, process
counts and optimizers start from copies of its checkpoints, and so does each kind of damage
(``DAMAGE``), resumed by the trainer and read by ``trainers.sample``, both run in this process.
"""

import functools
import json
import os
import pathlib
import random
import resource
import shutil
import signal
import subprocess
import sys
import time
import types
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import SingleDeviceSharding

import bv_sharding as bvs
from configs import lm
from tests.helpers import ROOT, environment, made_once, metrics, one_layer, run_module
from trainers import build, models, optimizers, steps
from trainers.rundir import checkpoint, checksums, events

STEPS = 8
CONFIG = "configs/lm.py"
RUN = (
    "--config.batch_size=16",
    "--config.seq_len=32",
    "--config.log_every=1",
    "--config.eval_every=1000",  # Eval only at the last step.
    "--config.eval_batches=1",
    "--config.ckpt_steps=2",
    "--config.keep_ckpt_steps=4",
    # A schedule that does not depend on total_steps, so runs of different lengths agree:
    # 2 warmup steps (big_vision's schedules end the warmup before the run), then constant.
    "--config.schedule.warmup_steps=2",
    "--config.schedule.decay_type=stair",
)
ENV = environment()


def start(workdir, *overrides, total=STEPS, log=None, config=CONFIG):
  """The trainer as a user starts it, in the background; output goes to `log` (workdir.log)."""
  log = pathlib.Path(log or pathlib.Path(workdir).with_suffix(".log"))
  cmd = [sys.executable, "-m", "trainers.train", f"--workdir={workdir}", f"--config={config}"]
  cmd += RUN
  cmd += [f"--config.total_steps={total}", *overrides]
  with open(log, "a") as f:
    proc = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=f, stderr=subprocess.STDOUT)
  proc.log = log
  return proc


def finish(proc, timeout=300):
  """Waits for `proc` (killing it after `timeout` seconds); returns (exit status, its output)."""
  try:
    status = proc.wait(timeout=timeout)
  except subprocess.TimeoutExpired:
    proc.kill()
    raise
  return status, proc.log.read_text()


def train(workdir, *overrides, total=STEPS, timeout=300, config=CONFIG):
  status, out = finish(start(workdir, *overrides, total=total, config=config), timeout)
  assert status == 0, out[-4000:]
  return out


def launch(workdir, *overrides, total=STEPS, timeout=300):
  """The same run as 2 jax.distributed processes x 4 devices."""
  args = ["--processes=2", "--devices-per-process=4", "--timeout=280", "--", f"--workdir={workdir}"]
  args += [f"--config={CONFIG}", *RUN, f"--config.total_steps={total}", *overrides]
  done = run_module("trainers.launch", *args, timeout=timeout)
  assert done.returncode == 0, done.stdout[-4000:]
  return done.stdout


def saved(workdir, step: int, item: str = "params"):
  """One item of a checkpoint as numpy arrays (restored onto one device)."""
  manager = checkpoint.open_manager(os.path.join(workdir, "checkpoints"), read_only=True)
  on_cpu = SingleDeviceSharding(jax.devices()[0])
  target = jax.tree.map(
      lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=on_cpu),
      manager.item_metadata(step)[item].tree,
  )
  tree = manager.restore(step, args=ocp.args.Composite(**{item: checkpoint.tree_restore(target)}))
  manager.close()
  return jax.tree.map(np.asarray, tree[item])


def wait_for(predicate, proc, timeout=240, every=0.001):
  deadline = time.monotonic() + timeout
  while not predicate():
    assert proc.poll() is None, "the run ended before the condition held"
    assert time.monotonic() < deadline, "timed out"
    time.sleep(every)


def logged_step(workdir) -> int:
  records = metrics(workdir)
  return records[-1]["step"] if records else 0


def assert_same_run(workdir, reference):
  """Every logged loss and the final params equal the uninterrupted run's, bit for bit; the
  TensorBoard curves hold each step once, as metrics.jsonl does."""
  got, want = metrics(workdir), metrics(reference)
  assert [r["step"] for r in got] == list(range(1, STEPS + 1))
  curves = events.read_scalars(workdir / "tensorboard")["loss"]
  assert curves == [(r["step"], pytest.approx(r["loss"], rel=1e-6)) for r in got]
  assert [r["loss"] for r in got] == [r["loss"] for r in want]
  assert got[-1]["eval_loss"] == want[-1]["eval_loss"]
  same = jax.tree.map(np.array_equal, saved(workdir, STEPS), saved(reference, STEPS))
  assert all(jax.tree.leaves(same))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  """The uninterrupted run, made once for both pytest-xdist workers (tests read or copy it)."""
  return made_once(tmp_path_factory, "checkpoint-reference", train)


@pytest.mark.timeout(600)
def test_uninterrupted_run_keeps_latest_and_kept_checkpoints(reference):
  # ckpt_steps=2, keep_ckpt_steps=4: 2 and 6 were deleted once a newer one was complete.
  assert sorted(os.listdir(reference / "checkpoints")) == ["4", "8"]
  assert [r["step"] for r in metrics(reference)] == list(range(1, STEPS + 1))
  start = json.loads((reference / "starts" / "0" / "start.json").read_text())
  assert start["start_step"] == 0 and start["versions"]["orbax-checkpoint"] == "0.12.8"
  assert "git_revision" in start and json.loads((reference / "config.json").read_text())


@pytest.mark.timeout(600)
def test_kill_at_a_random_step_then_resume_is_exact(tmp_path, reference):
  workdir, at = tmp_path / "run", random.randint(3, STEPS - 1)
  proc = start(workdir)
  ckpts = workdir / "checkpoints"
  complete = lambda: ckpts.exists() and any(n.isdigit() for n in os.listdir(ckpts))
  wait_for(lambda: logged_step(workdir) >= at and complete(), proc, every=0.01)
  proc.kill()
  finish(proc)
  logged = logged_step(workdir)
  out = train(workdir)
  resumed = int(out.split("resumed at step ")[1].split()[0])
  assert resumed <= logged and f"checkpoints/{resumed} " in out, (at, out[-3000:])
  if logged > resumed:  # The dead attempt's lines after the checkpoint were moved, not lost.
    moved = (workdir / "attempt-1" / "metrics.jsonl").read_text().splitlines()
    assert json.loads(moved[0])["step"] == resumed + 1 and len(moved) >= logged - resumed
  assert_same_run(workdir, reference)


@pytest.mark.timeout(600)
def test_kill_during_a_checkpoint_write_uses_the_previous_one(tmp_path, reference):
  workdir = tmp_path / "run"
  ckpts = workdir / "checkpoints"
  proc = start(workdir, "--config.ckpt_steps=1")

  def writing():  # The loop runs ahead of the writes (saves do not stall it): ask for both.
    names = os.listdir(ckpts) if ckpts.exists() else []
    return any("tmp" in n for n in names) and any(n.isdigit() for n in names)

  wait_for(writing, proc)
  proc.kill()
  finish(proc)
  cut = [n for n in os.listdir(ckpts) if "tmp" in n]
  complete = sorted(int(n) for n in os.listdir(ckpts) if n.isdigit())
  assert cut and complete, os.listdir(ckpts)  # The kill cut a write short; an older one is whole.
  out = train(workdir, "--config.ckpt_steps=1")
  assert f"resumed at step {complete[-1]} from {ckpts}/{complete[-1]} " in out, out[-3000:]
  assert not any("tmp" in n for n in os.listdir(ckpts))
  assert_same_run(workdir, reference)


@pytest.mark.timeout(600)
def test_sigterm_saves_exits_zero_and_resumes_exactly(tmp_path, reference):
  workdir = tmp_path / "run"
  proc = start(workdir)
  wait_for(lambda: logged_step(workdir) >= 3, proc, every=0.01)
  proc.send_signal(signal.SIGTERM)
  status, out = finish(proc)
  assert status == 0, out[-3000:]
  stopped = int(out.split("preempted: saved step ")[1].split()[0])
  assert stopped < STEPS and str(stopped) in os.listdir(workdir / "checkpoints")
  assert logged_step(workdir) == stopped
  out = train(workdir)
  assert f"resumed at step {stopped} from" in out
  assert_same_run(workdir, reference)


@pytest.mark.timeout(600)
def test_sigterm_stops_every_process_at_the_same_step(tmp_path):
  """Under trainers.launch (2 processes x 4 devices) jax's preemption sync point picks the step."""
  workdir, log = tmp_path / "run", tmp_path / "launch.log"
  cmd = [sys.executable, "-m", "trainers.launch", "--processes=2", "--devices-per-process=4"]
  cmd += ["--timeout=500", "--", f"--workdir={workdir}", f"--config={CONFIG}", *RUN]
  cmd += ["--config.total_steps=40"]
  with open(log, "w") as f:
    proc = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=f, stderr=subprocess.STDOUT)
  proc.log = log
  wait_for(lambda: logged_step(workdir) >= 3, proc, every=0.01)
  proc.send_signal(signal.SIGTERM)
  status, out = finish(proc, timeout=500)
  assert status == 0, out[-3000:]
  stopped = {
      line.split("] ")[0]: line.split("saved step ")[1].split()[0]
      for line in out.splitlines()
      if "preempted: saved step" in line
  }
  assert set(stopped) == {"[p0", "[p1"} and len(set(stopped.values())) == 1, stopped
  step = int(stopped["[p0"])
  assert max(int(n) for n in os.listdir(workdir / "checkpoints")) == step
  assert logged_step(workdir) == step < 40


def copy_at(reference, workdir, step):
  """A copy of the reference workdir holding only its checkpoint at `step`."""
  shutil.copytree(reference, workdir)
  for name in os.listdir(workdir / "checkpoints"):
    if name.isdigit() and int(name) != step:
      shutil.rmtree(workdir / "checkpoints" / name)
  return workdir


@pytest.mark.timeout(900)
def test_restore_across_meshes_and_process_counts(tmp_path, reference):
  """8 devices -> mesh (4, 2) -> 2 processes x 4 -> 2 devices -> 1 device, one step each."""
  workdir = copy_at(reference, tmp_path / "run", 4)
  want = {r["step"]: r["loss"] for r in metrics(reference)}
  hops = [
      (5, lambda: train(workdir, "--config.mesh=(('data', 4), ('model', 2))", total=5)),
      (6, lambda: launch(workdir, total=6)),
      (7, lambda: train(workdir, "--devices_per_process=2", total=7)),
      (8, lambda: train(workdir, "--devices_per_process=1", total=8)),
  ]
  for step, hop in hops:
    out = hop()
    assert f"resumed at step {step - 1} from" in out, out[-3000:]
    assert "state shardings match the plan after restore" in out
    # A step on the restored values: the loss the 8-device run logged (up to reduction order).
    assert metrics(workdir)[-1]["loss"] == pytest.approx(want[step], rel=1e-5)
  assert [r["step"] for r in metrics(workdir)] == list(range(1, STEPS + 1))


def tiny_lm(optax_name="adamw"):
  """The tiny Llama and optimizer of configs/lm.py, for restoring in this process."""
  model = models.get_model("llama", size="tiny", scan_layers=False, remat=False)
  init = lambda: model.init(jax.random.key(0), np.zeros((1, 32), np.int32))["params"]
  schedule = {"warmup_steps": 2, "decay_type": "cosine", "total_steps": STEPS}
  tx = optimizers.make_optimizer(
      optax_name, 3e-3, schedule=schedule, weight_decay=1e-4, clip_norm=1.0
  )
  return init, tx


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
  state, start = checkpoint.restore(manager, STEPS, plan, tx, adamw)
  assert start.step == STEPS and plan.mismatches(state) == []
  want = {"params": saved(reference, STEPS), "opt": saved(reference, STEPS, "opt")}
  got = checkpoint.leaf_table(state)
  assert got == checkpoint.leaf_table(want)
  flat_got = dict(zip(got, jax.tree.leaves(state)))
  flat_want = dict(zip(checkpoint.leaf_table(want), jax.tree.leaves(want)))
  assert all(np.array_equal(np.asarray(flat_got[k]), flat_want[k]) for k in flat_want)


def lm_in(dtype: str):
  """configs/lm.py as RUN trains it, its params and optimizer state stored in ``dtype``."""
  config = lm.get_config()
  config.batch_size, config.seq_len, config.total_steps = 16, 32, STEPS
  config.schedule = {"warmup_steps": 2, "decay_type": "stair"}
  config.param_dtype = config.state_dtype = dtype
  return build.build(config, bvs.make_mesh(config.mesh))


def assert_restores_cast(workdir, step: int, dtype: str) -> None:
  """The checkpoint at ``step`` restored onto the plan of ``lm_in(dtype)``: every saved array
  cast to the plan's dtype (floats) or as saved, in the plan's shardings."""
  run = lm_in(dtype)
  manager = checkpoint.open_manager(str(workdir / "checkpoints"), read_only=True)
  state, start = checkpoint.restore(manager, step, run.plan, run.tx, run.migration)
  assert start.step == step and run.plan.mismatches(state) == []
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
    assert records[-4]["lr"] > 0.0  # The schedule continues at the global step.
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
  # Adam's first moment and count, now Kron's (the ramp's chain nests Kron's state deeper).
  assert "carried over: opt/1/0/mu/embed/embedding -> opt/0/1/0/mu/embed/embedding," in out
  assert "opt/1/0/mu/lm_head/kernel -> opt/0/1/0/mu/lm_head/kernel" in out
  assert "opt/1/0/count -> opt/0/1/0/count" in out
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
  assert counts == {"0/1/0/count": 40, "0/1/0/update_counter": counts["0/1/0/update_counter"]} | {
      "0/1/2/count": 40,
      "1/count": 20,
  }


# Eval at every step, checkpoints only at steps 20 and 40.
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


@pytest.mark.timeout(700)
@pytest.mark.parametrize(
    ("before", "after", "logged"),
    [
        ("kron", "adamw", "born afresh: opt/1/0/count, opt/1/0/mu/*, opt/1/0/nu/*"),
        # adamw's first 20 steps made once for both changes from it (made_once).
        ("adamw", "lamb", "opt/1/0/count -> opt/1/0/count; born afresh: nothing"),
        ("adamw", "sgd", "opt/1/0/mu/embed/embedding -> opt/2/0/trace/embed/embedding"),
        ("lamb", "adamw", "opt/1/0/count -> opt/1/0/count; born afresh: nothing"),
        ("muon", "shampoo", "/momentum; born afresh: opt/1/0/count,"),
    ],
)
def test_optimizer_changes_at_step_20_of_40_do_not_raise_the_loss(
    tmp_path, first_20_steps, before, after, logged
):
  """The new optimizer's moments and counts consistent (bv_sharding/optimizers/rebirth.py): no
  eval loss after the change above the step-20 one + 0.1. kron -> adamw, when Kron's count
  corrected Adam's zero nu, logged a train loss of 23.8 at step 22 (5.4 at step 20). The eval
  loss (the same held-out batch at every step) is the yardstick: the train batches' own
  difficulty moves their loss by up to 0.35 (an unchanged adamw run: 3.10 at 20, 3.41 at 23).
  adamw -> sgd: SGD's trace born from Adam's mu."""
  workdir = shutil.copytree(first_20_steps(before), tmp_path / "run")
  out = train(workdir, f"--config.optax_name={after}", *CHANGE, total=40, timeout=600)
  assert logged in out, out[-3000:]
  records = metrics(workdir)
  assert [r["step"] for r in records] == list(range(1, 41))
  assert all(np.isfinite(r["loss"]) for r in records)
  limit = records[19]["eval_loss"] + 0.1
  assert max(r["eval_loss"] for r in records[20:]) <= limit, (before, after, records[19:])


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
def test_checkpoint_of_another_model_fails_before_anything_is_written(tmp_path, reference):
  workdir = copy_at(reference, tmp_path / "run", STEPS)
  before = (workdir / "metrics.jsonl").read_text()
  listing = sorted(os.listdir(workdir / "checkpoints"))
  status, out = finish(start(workdir, "--config.model.size=small"))
  assert status != 0 and "CheckpointMismatchError" in out, out[-3000:]
  assert f"checkpoint {workdir}/checkpoints/{STEPS} is of another model: params/" in out
  assert out.count("CheckpointMismatchError: ") == 1
  assert (workdir / "metrics.jsonl").read_text() == before
  assert sorted(os.listdir(workdir / "checkpoints")) == listing
  assert sorted(os.listdir(workdir / "starts")) == ["0"] and "resumed at step" not in out


@pytest.mark.timeout(300)
def test_a_resume_with_total_steps_below_the_checkpoint_fails_before_anything_is_written(
    tmp_path, reference
):
  workdir = copy_at(reference, tmp_path / "run", STEPS)
  before = (workdir / "metrics.jsonl").read_text()
  status, out = finish(start(workdir, total=STEPS - 2))
  assert status == 1, out[-3000:]
  assert out.splitlines()[-1] == (
      f"ConfigError: config.total_steps={STEPS - 2} is below step {STEPS} of the checkpoint in "
      f"{workdir}: there is nothing left to train; raise config.total_steps to continue, or give "
      "a new --workdir"
  )
  assert (workdir / "metrics.jsonl").read_text() == before
  assert sorted(os.listdir(workdir / "starts")) == ["0"]


@pytest.mark.timeout(300)
def test_model_init_without_a_checkpoint_fails_before_training(tmp_path):
  status, out = finish(start(tmp_path / "run", f"--config.model_init={tmp_path}/nothing"))
  assert status != 0 and "ConfigError" in out
  assert f"config.model_init={tmp_path}/nothing: no complete checkpoint at" in out, out[-3000:]
  assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.timeout(300)
def test_unwritable_workdir_fails_before_training(tmp_path):
  blocker = tmp_path / "a_file"
  blocker.write_text("")
  status, out = finish(start(blocker / "run", log=tmp_path / "log"))
  assert status != 0
  assert f"--workdir={blocker}/run: {blocker} is a file, not a directory" in out, out[-3000:]
  assert "ConfigError" in out
  assert "initialising params" not in out


@functools.cache
def blocked_lm(optax_name: str, block_size: int, devices: int) -> build.Run:
  """``one_layer``'s configs/lm.py (a one-layer tiny Llama) with ``optax_name`` on ``devices``,
  built as the trainer builds it."""
  config = lm.get_config()
  config.model.n_layers = 1
  config.optax_name, config.optax, config.total_steps = optax_name, {"block_size": block_size}, 8
  config.schedule.warmup_steps = 2
  return build.build(config, bvs.make_mesh([("data", devices)], devices=jax.devices()[:devices]))


def assert_state_as_saved_after_restore(workdir, optax_name, block_size, devices, step):
  """The checkpoint written on 8 devices, restored onto ``devices``: every leaf as saved (the
  state is the same on any mesh), in this run's plan, some of them block stacks."""
  run = blocked_lm(optax_name, block_size, devices)
  manager = checkpoint.open_manager(str(workdir / "checkpoints"), read_only=True)
  state, _ = checkpoint.restore(manager, step, run.plan, run.tx, run.migration)
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
  devices (state re-initialised). The tiny Llama with one layer: every kind of param of two,
  in about half the compile."""
  workdir, config = tmp_path / "run", one_layer(tmp_path)
  run = [f"--config.optax_name={optax_name}", f"--config.optax.block_size={block_size}"]
  run += ["--config.optax.blocking=local"] if how == "re-initialised" else []
  # Kron's and Shampoo's train steps take minutes to compile on a loaded 2-core host.
  train(workdir, *run, total=4, timeout=900, config=config)
  out = train(
      workdir, *run, f"--devices_per_process={devices}", total=6, timeout=900, config=config
  )
  assert "resumed at step 4 from" in out, out[-3000:]
  if how == "kept":
    assert "restored on mesh {'data': 2} as saved" in out and "re-initialised" not in out, out
    assert_state_as_saved_after_restore(workdir, optax_name, block_size, devices, 4)
  else:
    assert "optimizer state re-initialised (its blocks differ on this mesh: opt/" in out
  losses = [r["loss"] for r in metrics(workdir)]
  assert len(losses) == 6 and np.isfinite(losses).all() and losses[-1] < losses[0], losses


def flip_bytes(path: pathlib.Path, count: int = 64) -> None:
  """Inverts ``count`` bytes in the middle of file ``path`` (the disk's damage)."""
  data = bytearray(path.read_bytes())
  middle = len(data) // 2
  data[middle : middle + count] = bytes(b ^ 0xFF for b in data[middle : middle + count])
  path.write_bytes(bytes(data))


def largest_data_file(step_dir: pathlib.Path, item: str) -> pathlib.Path:
  return max((step_dir / item).rglob("d/*"), key=lambda p: p.stat().st_size)


class Damage(NamedTuple):
  """One kind of damage to a workdir holding steps 4 and 8 (``make(checkpoints)``): the folder
  it leaves that does not check out, what a read of it says, the step a resume starts from and
  the newest step whose params check out (``load_params`` reads params only: damage to the opt
  state is not its to see)."""

  make: Callable[[pathlib.Path], None]
  folder: str
  says: str
  resumes: int
  params: int


DAMAGE = {
    "bits in a params file": Damage(
        lambda ckpts: flip_bytes(largest_data_file(ckpts / "8", "params")),
        "8",
        ": params/",  # ... <leaf> does not match the checksum saved with it
        4,
        4,
    ),
    "bits in an opt file": Damage(
        lambda ckpts: flip_bytes(largest_data_file(ckpts / "8", "opt")), "8", ": opt/", 4, 8
    ),
    "a renamed step folder": Damage(
        lambda ckpts: os.rename(ckpts / "8", ckpts / "12"),
        "12",
        " holds step 8: its folder was renamed",
        4,
        4,
    ),
    "an empty stray step folder": Damage(
        lambda ckpts: (ckpts / "12").mkdir(), "12", " cannot be read (", 8, 8
    ),
    "a truncated metadata file": Damage(
        lambda ckpts: (ckpts / "8" / "params" / "_METADATA").write_text(
            (ckpts / "8" / "params" / "_METADATA").read_text()[:40]
        ),
        "8",
        " cannot be read (",
        4,
        4,
    ),
}


def damaged_copy(reference, workdir, damage: str | None):
  """A copy of the reference workdir with its steps 4 and 8, damaged by ``DAMAGE[damage]``
  (None: not yet)."""
  copy_at(reference, workdir, 8)
  shutil.copytree(reference / "checkpoints" / "4", workdir / "checkpoints" / "4")
  if damage is not None:
    DAMAGE[damage].make(workdir / "checkpoints")
  return workdir


def train_here(workdir, caplog, *overrides, total=STEPS) -> str:
  """``python -m trainers.train`` with ``RUN``, in this process (no interpreter to start, the
  programs compiled already in memory or in the session's cache): its log (INFO and up)."""
  from absl import flags

  from trainers import train as trainer
  from trainers.settings import cli

  argv = ["train", f"--workdir={workdir}", f"--config={CONFIG}", *RUN]
  argv += [f"--config.total_steps={total}", *overrides]
  on_sigterm, on_argv = signal.getsignal(signal.SIGTERM), sys.argv
  sys.argv = argv  # Where the --config.key=value overrides are read from.
  caplog.clear()
  try:
    cli.parse_flags(argv)
    caplog.set_level("INFO", logger="absl")
    cli.command(trainer.main)(argv)
  finally:
    sys.argv = on_argv
    signal.signal(signal.SIGTERM, on_sigterm)  # The run's Preemption handler.
    flags.FLAGS.unparse_flags()
    for name in [name for name in flags.FLAGS if name.startswith("config.")]:
      delattr(flags.FLAGS, name)  # Each run defines the overrides it names.
  return caplog.text


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_step_is_never_loaded_and_the_previous_good_one_is(tmp_path, reference, damage):
  """As ``trainers.sample`` and ``config.model_init`` read params (``load_params``)."""
  workdir = damaged_copy(reference, tmp_path / "run", damage)
  run = lm_in("float32")
  with jax.set_mesh(run.mesh):
    params, source = checkpoint.load_params(str(workdir), run.plan)
  good = DAMAGE[damage].params
  assert source == f"{workdir}/checkpoints/{good}"
  same = jax.tree.map(lambda a, b: np.array_equal(np.asarray(a), b), params, saved(reference, good))
  assert all(jax.tree.leaves(same))
  newest = max(int(n) for n in os.listdir(workdir / "checkpoints") if n.isdigit())
  if newest != good:  # Named, the damaged step is refused in one error naming it.
    with pytest.raises(checkpoint.DamagedCheckpointError, match=f"checkpoints/{newest}"):
      checkpoint.load_params(str(workdir / "checkpoints" / str(newest)), run.plan)


def flip_bit(path: pathlib.Path) -> None:
  """Flips one bit in the middle of file ``path``."""
  data = bytearray(path.read_bytes())
  data[len(data) // 2] ^= 0x10
  path.write_bytes(bytes(data))


def swap_words(path: pathlib.Path) -> None:
  """Swaps two different 4-byte words 64 bytes apart in the middle of file ``path`` (in an
  uncompressed data file: two elements, or parts of them, trade places)."""
  data = bytearray(path.read_bytes())
  i = len(data) // 2
  while data[i : i + 4] == data[i + 64 : i + 68]:
    i += 4
  data[i : i + 4], data[i + 64 : i + 68] = data[i + 64 : i + 68], data[i : i + 4]
  path.write_bytes(bytes(data))


def truncate(path: pathlib.Path) -> None:
  path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


# The least damage to step 8's largest params data file that a read must still find.
LEAST_DAMAGE = {"one flipped bit": flip_bit, "two swapped words": swap_words, "a cut": truncate}


@pytest.mark.parametrize("damage", LEAST_DAMAGE)
def test_the_least_damage_to_a_params_file_is_found(tmp_path, reference, caplog, damage):
  workdir = damaged_copy(reference, tmp_path / "run", None)
  LEAST_DAMAGE[damage](largest_data_file(workdir / "checkpoints" / "8", "params"))
  run = lm_in("float32")
  with jax.set_mesh(run.mesh):
    _, source = checkpoint.load_params(str(workdir), run.plan)
  assert source == f"{workdir}/checkpoints/4"
  assert f"checkpoint {workdir}/checkpoints/8" in caplog.text


@pytest.mark.parametrize("saved_with", ["format 1 sums", "no sums"])
def test_checkpoints_saved_before_format_2_are_checked_as_saved(tmp_path, reference, saved_with):
  """A meta without "sums_format" holds format 1 checksums (bit patterns times 2 i + 1): they
  are checked in that format; one without "sums" (saved before checksums) is read unchecked."""
  workdir = damaged_copy(reference, tmp_path / "run", None)
  for step in (4, 8):
    path = workdir / "checkpoints" / str(step) / "meta" / "metadata"
    meta = json.loads(path.read_text())
    del meta["sums"], meta["sums_format"]
    if saved_with == "format 1 sums":
      meta["sums"] = {
          f"{item}/{leaf}": s
          for item in ("params", "opt")
          for leaf, s in checksums.of(
              jax.tree.map(jnp.asarray, saved(workdir, step, item)), 1
          ).items()
      }
    path.write_text(json.dumps(meta))
  run = lm_in("float32")
  with jax.set_mesh(run.mesh):
    assert checkpoint.load_params(str(workdir), run.plan)[1].endswith("checkpoints/8")
    flip_bytes(largest_data_file(workdir / "checkpoints" / "8", "params"))
    _, source = checkpoint.load_params(str(workdir), run.plan)
  assert source == f"{workdir}/checkpoints/{4 if saved_with == 'format 1 sums' else 8}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("damage", DAMAGE)
def test_the_trainer_resumes_from_the_newest_step_that_checks_out_and_says_why(
    tmp_path, reference, caplog, damage
):
  workdir = damaged_copy(reference, tmp_path / "run", damage)
  ckpts, kind = workdir / "checkpoints", DAMAGE[damage]
  out = train_here(workdir, caplog)
  assert f"checkpoint {ckpts}/{kind.folder}{kind.says}" in out, out[-3000:]
  assert f"resumed at step {kind.resumes} from {ckpts}/{kind.resumes} " in out
  assert_same_run(workdir, reference)
  assert (ckpts / f"damaged-{kind.folder}").is_dir()  # Moved aside, not deleted.


@pytest.mark.timeout(300)
def test_the_trainer_stops_in_one_line_when_no_step_checks_out(tmp_path, reference, caplog, capsys):
  workdir = damaged_copy(reference, tmp_path / "run", "bits in a params file")
  flip_bytes(largest_data_file(workdir / "checkpoints" / "4", "params"))
  before = (workdir / "metrics.jsonl").read_text()
  with pytest.raises(SystemExit) as exited:
    train_here(workdir, caplog)
  err = capsys.readouterr().err
  assert exited.value.code == 1 and err.splitlines() == [err.strip()], err
  assert err.startswith(
      f"DamagedCheckpointError: no checkpoint in {workdir}/checkpoints checks out ("
  ), err
  assert (workdir / "metrics.jsonl").read_text() == before


@pytest.mark.timeout(300)
@pytest.mark.parametrize("damage", DAMAGE)
def test_sampling_falls_back_to_the_newest_params_that_check_out_and_says_why(
    tmp_path, reference, caplog, capsys, damage
):
  """``python -m trainers.sample``, in this process, on each damaged copy."""
  from trainers import sample

  workdir = damaged_copy(reference, tmp_path / "run", damage)
  ckpts, kind = workdir / "checkpoints", DAMAGE[damage]
  listed = sorted(os.listdir(ckpts))
  caplog.set_level("WARNING", logger="absl")
  sample.main([f"--workdir={workdir}", "--prompt=the", "--max_new_tokens=1", "--temperature=0"])
  err = capsys.readouterr().err
  assert f"sampling from {ckpts}/{kind.params} on 8 devices" in err, err
  if kind.folder != str(kind.params):  # Damage to the opt state is not sampling's to see.
    assert f"checkpoint {ckpts}/{kind.folder}{kind.says}" in caplog.text, caplog.text
    assert "trying the previous checkpoint" in caplog.text
  assert sorted(os.listdir(ckpts)) == listed  # Sampling moves nothing.


def no_room_to_write(limit: int = 200_000):
  """In a child before it runs: files cannot grow past ``limit`` bytes (writes then fail with
  EFBIG, as on a full disk with ENOSPC), without the signal that would kill it."""
  signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
  resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))


def test_a_write_that_finds_no_room_is_one_line(tmp_path, monkeypatch):
  """The room is checked before each save (above); a disk that fills during the write gives
  the same line from the error orbax raises (ENOSPC here, as TensorStore reports it)."""
  config = ml_collections.ConfigDict(dict(total_steps=STEPS, ckpt_steps=2))
  ckpt = checkpoint.Checkpoints(str(tmp_path), config, optimizers.BuiltOptimizer("adamw", {}))
  ckpt.state_bytes = 3 * 2**20
  monkeypatch.setattr(shutil, "disk_usage", lambda path: types.SimpleNamespace(free=2**20))
  with pytest.raises(checkpoint.CheckpointWriteError, match="would fail: no space left on device"):
    ckpt.check_room()
  with pytest.raises(checkpoint.CheckpointWriteError) as raised, ckpt.writing():
    raise OSError(28, "No space left on device")
  assert str(raised.value) == (
      f"saving a checkpoint into {tmp_path}/checkpoints failed: no space left on device (errno "
      "28). A checkpoint of this state needs about 3.0 MiB there: free it, or give another "
      "--workdir (the last checkpoint, no checkpoint was completed yet)"
  )


@pytest.mark.timeout(300)
def test_a_save_that_finds_no_room_is_one_line_and_the_last_checkpoint_resumes(tmp_path, reference):
  workdir = copy_at(reference, tmp_path / "run", 4)
  cmd = [sys.executable, "-m", "trainers.train", f"--workdir={workdir}", f"--config={CONFIG}", *RUN]
  done = subprocess.run(
      [*cmd, f"--config.total_steps={STEPS}"],
      cwd=ROOT,
      env=ENV,
      capture_output=True,
      text=True,
      preexec_fn=no_room_to_write,
      timeout=240,
  )
  assert done.returncode == 1, done.stderr[-3000:]
  assert done.stderr.splitlines()[-1] == (
      f"CheckpointWriteError: saving a checkpoint into {workdir}/checkpoints would fail (this "
      "process's file size limit: 200000 bytes): file too large (errno 27). A checkpoint of this "
      "state needs about 5.6 MiB there: free it, or give another --workdir (the last "
      "checkpoint, step 4 is intact)"
  )
  assert "Traceback" not in done.stderr  # Checked before orbax starts a write that would fail.
  train(workdir)  # Room again: it resumes from step 4 and ends as the uninterrupted run.
  assert_same_run(workdir, reference)
