"""trainers/hooks/preemption.py: SIGTERM saves the step every process agrees on and stops the
loop; the run exits 0 and a run on the same workdir resumes from that step exactly.
"""

import os
import signal
import subprocess
import sys
from types import SimpleNamespace

import pytest

from tests.helpers import ROOT
from tests.trainer import runs
from tests.trainer.runs import (
    CONFIG,
    ENV,
    RUN,
    STEPS,
    assert_same_run,
    finish,
    logged_step,
    start,
    train,
    wait_for,
)
from trainers import loop
from trainers.hooks import divergence, preemption


def test_a_sigterm_saves_the_step_it_reached_and_stops_the_loop():
  """In this process: SIGTERM during step 3; the "preemption" hook saves step 3 (its pending
  metrics read first, as before any save) and stops the loop there."""
  events, on_sigterm = [], signal.getsignal(signal.SIGTERM)

  def train_step(state, batch):
    events.append(("step", batch))
    if batch == 3:
      os.kill(os.getpid(), signal.SIGTERM)
    return state + batch, {"loss": 1.0, "l2_params": 1.0}

  def preempted(step, state, before_save):
    before_save()
    events.append(("saved", step, state))

  try:
    looped = loop.Loop(
        train_step, divergence.LossWatch("stop", 0.1), None, SimpleNamespace(total_steps=9)
    )
    looped.add_hook(
        name="metrics", every=5, read=lambda step, metrics, params: events.append(("read", step))
    )
    looped.add_hook(
        preemption.hook(preemption.Preemption(), looped.settled(preempted)), name="preemption"
    )
    assert looped.run(0, zip(range(1, 10), range(1, 10))) == 6
  finally:
    signal.signal(signal.SIGTERM, on_sigterm)
  assert events == [
      ("step", 1),
      ("step", 2),
      ("read", 1),
      ("step", 3),
      ("read", 2),
      ("read", 3),
      ("saved", 3, 6),
  ]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  return runs.reference(tmp_path_factory)


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
