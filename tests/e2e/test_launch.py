"""trainers/launch.py: 2 jax.distributed processes x 4 devices train exactly as 1 x 8."""

import json
import pathlib

import pytest

from tests.helpers import quick_lm, run_module

TRAIN = (
    "--config=configs/lm.py",
    *quick_lm(total_steps=4, log_every=1, eval_every=4, eval_batches=1),
)


def run(module, *args, timeout=200):
  done = run_module(module, *args, timeout=timeout)
  assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
  return done.stdout + done.stderr


def losses(workdir):
  lines = pathlib.Path(workdir, "metrics.jsonl").read_text().splitlines()
  return [(r["loss"], r.get("eval_loss")) for r in map(json.loads, lines)]


@pytest.mark.timeout(300)
def test_two_processes_match_one(tmp_path):
  one, two = tmp_path / "1x8", tmp_path / "2x4"
  run("trainers.train", f"--workdir={one}", "--devices_per_process=8", *TRAIN)
  out = run(
      "trainers.launch",
      "--processes=2",
      "--devices-per-process=4",
      "--timeout=200",
      "--",
      f"--workdir={two}",
      *TRAIN,
  )
  assert "[p1] " in out and "process 1 of 2, 8 devices (4 here)" in out
  expected, got = losses(one), losses(two)
  assert len(got) == len(expected) == 4
  for (a, _), (b, _) in zip(expected, got):
    assert b == pytest.approx(a, rel=1e-5)
  assert got[-1][1] == pytest.approx(expected[-1][1], rel=1e-5)


@pytest.mark.timeout(120)
def test_launch_fails_when_a_process_fails(tmp_path):
  done = run_module(
      "trainers.launch",
      "--processes=2",
      "--devices-per-process=4",
      "--timeout=100",
      "--",
      f"--workdir={tmp_path}",
      "--config=configs/lm.py",
      "--config.optax_name=nope",
      timeout=110,
  )
  assert done.returncode != 0
  assert "[p0] " in done.stdout and "config.optax_name='nope' is neither" in done.stdout
