"""trainers/hosts/distributed.py: jax.distributed starts where the environment names a cluster;
trainers/hosts/same_job.py: two real processes that differ in one key stop before init, naming it.
"""

import pathlib
import shutil
import subprocess
from subprocess import PIPE, STDOUT

import pytest

from configs import lm
from tests.helpers import ROOT, SLURM, environment
from trainers import launch
from trainers.hosts import distributed, same_job


def test_cluster_detection_reads_the_environment(monkeypatch):
  for name in SLURM:
    monkeypatch.delenv(name, raising=False)
  assert distributed.detected_cluster() is None
  assert distributed.start(None, 1, 0, auto=True) == "single process"
  for name, value in zip(SLURM, ("7", "node[001-002]", "2", "1", "0")):
    monkeypatch.setenv(name, value)
  assert distributed.detected_cluster() == "slurm"
  assert distributed.start(None, 1, 0, auto=False) == "single process"  # --nodistributed_auto


def start_two(workdir, differ: list[str], *common: str) -> list[tuple[int, str]]:
  """Two real jax.distributed processes of `trainers.train` (one device each) on 127.0.0.1, the
  second with `differ` added; (exit status, output) of each."""
  cmds = launch.commands(2, 1, [f"--workdir={workdir}", "--config=configs/lm.py", *common])
  cmds[1] += differ
  procs = [
      subprocess.Popen(cmd, cwd=ROOT, env=environment(), stdout=PIPE, stderr=STDOUT, text=True)
      for cmd in cmds
  ]
  return [(p.returncode, out) for p in procs for out in [p.communicate(timeout=240)[0]]]


def assert_stopped_at(done, workdir, mine: str, theirs: str) -> None:
  """Both processes ended with one ConfigError line naming the key, with both values, before
  anything was allocated or written."""
  for i, (status, out) in enumerate(done):
    here, there = (mine, theirs) if i == 0 else (theirs, mine)
    last = out.strip().splitlines()[-1]
    assert status == 1, out[-3000:]
    assert last.startswith(
        f"ConfigError: {here} here, {there.partition('=')[2]} on process {1 - i}"
    )
    assert "initialising params" not in out
  assert not pathlib.Path(workdir).exists()


@pytest.mark.timeout(300)
def test_processes_that_differ_only_in_lr_stop_naming_it(tmp_path):
  done = start_two(tmp_path / "run", ["--config.lr=0.002"])
  assert_stopped_at(done, tmp_path / "run", f"config.lr={lm.get_config().lr!r}", "config.lr=0.002")


@pytest.mark.timeout(300)
def test_processes_that_differ_only_in_a_data_path_stop_naming_it(tmp_path):
  first, second = tmp_path / "a.txt", tmp_path / "b.txt"
  first.write_text("the same text on both hosts\n" * 200)
  shutil.copy(first, second)
  done = start_two(
      tmp_path / "run", [f"--config.input.train={second}"], f"--config.input.train={first}"
  )
  mine, theirs = f"config.input.train={str(first)!r}", f"config.input.train={str(second)!r}"
  assert_stopped_at(done, tmp_path / "run", mine, theirs)


def test_the_job_lines_hold_every_config_key_and_data_size():
  config = lm.get_config()
  lines = same_job.job_lines(config, {"--workdir": "runs/lm", "version jax": "0.10.2"})
  assert lines[:2] == ["--workdir=runs/lm", "version jax=0.10.2"]
  assert f"config.lr={config.lr!r}" in lines and "config.schedule.decay_type='cosine'" in lines
  sizes = [line for line in lines if line.startswith("size of ")]
  assert len(sizes) > 10 and all(int(line.rpartition("=")[2]) > 0 for line in sizes)
