"""The trainer run as a user runs it, for the tests of durable runs (``test_checkpoint.py``,
``test_start.py``, ``test_preemption.py``): ``python -m trainers.train`` on ``RUN``'s tiny LM
(configs/lm.py with one layer: every kind of param of two, in about half the compile) in a
subprocess, its checkpoints read back, and the uninterrupted ``STEPS``-step run they all
compare with (:func:`reference`, made once in the session).
"""

import os
import pathlib
import shutil
import subprocess
import sys
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import SingleDeviceSharding

import bv_sharding as bvs
from configs import lm
from tests.helpers import ROOT, environment, made_once, metrics, run_module
from trainers import build
from trainers.rundir import checkpoint, events

STEPS = 8
CONFIG = "configs/lm.py:layers=1"
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


def copy_at(reference, workdir, step):
  """A copy of the reference workdir holding only its checkpoint at `step`."""
  shutil.copytree(reference, workdir)
  for name in os.listdir(workdir / "checkpoints"):
    if name.isdigit() and int(name) != step:
      shutil.rmtree(workdir / "checkpoints" / name)
  return workdir


def lm_in(dtype: str):
  """``CONFIG`` as RUN trains it, its params and optimizer state stored in ``dtype``."""
  config = lm.get_config("layers=1")
  config.batch_size, config.seq_len, config.total_steps = 16, 32, STEPS
  config.schedule = {"warmup_steps": 2, "decay_type": "stair"}
  config.param_dtype = config.state_dtype = dtype
  return build.build(config, bvs.make_mesh(config.mesh))



def reference(tmp_path_factory) -> pathlib.Path:
  """The uninterrupted run, made once for every module and pytest-xdist worker (tests read or
  copy it); each test module's ``reference`` fixture returns it."""
  return made_once(tmp_path_factory, "checkpoint-reference", train)
