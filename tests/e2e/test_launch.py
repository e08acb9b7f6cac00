"""trainers/launch.py: 2 jax.distributed processes x 4 devices train exactly as 1 x 8; a bad input
ends it before anything is spawned."""

import socket
import subprocess
import sys
import time

import pytest

from tests.helpers import (
    ROOT,
    assert_snake_case_help,
    help_text,
    metrics,
    quick_lm,
    run_module,
    train,
)
from trainers import launch
from trainers.errors import ConfigError

TRAIN = quick_lm(total_steps=4, log_every=1, eval_every=4, eval_batches=1)


def losses(workdir):
  return [(r["loss"], r.get("eval_loss")) for r in metrics(workdir)]


@pytest.mark.timeout(300)
def test_two_processes_match_one(tmp_path):
  one, two = tmp_path / "1x8", tmp_path / "2x4"
  status, out, _ = train(one, "--devices_per_process=8", *TRAIN, timeout=200)
  assert status == 0, out[-3000:]
  done = run_module(
      "trainers.launch",
      "--processes=2",
      "--devices_per_process=4",
      "--timeout=200",
      "--",
      f"--workdir={two}",
      "--config=configs/lm.py",
      *TRAIN,
      timeout=200,
  )
  out = done.stdout + done.stderr
  assert done.returncode == 0, out[-3000:]
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
  # The dashed spelling of before still works, with a note.
  assert done.stderr == "--devices-per-process is deprecated: use --devices_per_process\n"


def test_rejects_counts_before_spawning(tmp_path, capsys):
  """--devices_per_process 0 segfaulted both processes; --processes 0 exited 0 doing nothing."""
  cases = {
      "--processes=0": (0, 4, 60),
      "--processes=-2": (-2, 4, 60),
      "--devices_per_process=0": (2, 0, 60),
      "--devices_per_process=-1": (2, -1, 60),
      "--timeout=0": (2, 4, 0),
  }
  for flag, args in cases.items():
    with pytest.raises(ConfigError, match=flag):
      launch.check_args(*args)
  for args, line in [
      (["--processes=0"], "--processes=0: must be an integer >= 1, e.g. --processes=2"),
      (["--processes=two"], "argument --processes: invalid int value: 'two'; see"),
  ]:
    with pytest.raises(SystemExit) as exited:
      launch.main([*args, "--", "--config=configs/lm.py", f"--workdir={tmp_path}/w"])
    out = capsys.readouterr()
    assert exited.value.code == 1 and out.out == "" and out.err.startswith(f"ConfigError: {line}")
    assert len(out.err.splitlines()) == 1, out.err
  assert not (tmp_path / "w").exists()


def test_help_shows_snake_case_flags_only(capsys):
  assert_snake_case_help(help_text(launch.main, capsys), "--devices_per_process", "--timeout")


def test_no_process_outlives_a_killed_launcher():
  # launch.run over two sleepers, in a launcher process of its own, then kill -9 of it.
  code = (
      "import sys; from trainers import launch; "
      "launch.run([[sys.executable, '-c', 'import os, time; print(os.getpid(), flush=True); "
      "time.sleep(600)']] * 2, 600)"
  )
  launcher = subprocess.Popen(
      [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=ROOT
  )
  children = [int(launcher.stdout.readline().split()[-1]) for _ in range(2)]
  assert all(alive(pid) for pid in children)
  launcher.kill()
  launcher.wait()
  deadline = time.monotonic() + 10
  while any(alive(pid) for pid in children) and time.monotonic() < deadline:
    time.sleep(0.1)
  assert not any(alive(pid) for pid in children)


def alive(pid: int) -> bool:
  """Whether process ``pid`` runs (a zombie, dead but not yet reaped by init, does not)."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[0] != "Z"
  except FileNotFoundError:
    return False


def test_a_taken_coordinator_port_and_a_missing_peer_are_one_line(tmp_path):
  with socket.socket() as taken:
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    address = f"127.0.0.1:{taken.getsockname()[1]}"
    status, out, _ = train(tmp_path, f"--coordinator_address={address}", "--num_processes=2")
  assert status == 1 and out.splitlines()[-1] == (
      f"ConfigError: --coordinator_address={address}: port {address.split(':')[1]} is in use "
      "on this host; give the job a free port (trainers.launch picks one)"
  )
  address = f"127.0.0.1:{launch.free_port()}"
  start = time.monotonic()
  status, out, _ = train(
      tmp_path, f"--coordinator_address={address}", "--num_processes=2", "--distributed_timeout=3"
  )
  assert status == 1 and time.monotonic() - start < 60
  assert out.splitlines()[-1] == (
      f"ConfigError: --coordinator_address={address}: process 0 waited for the other 1 (ids "
      "1..1) of 2 for 3 s; start every process with the same address, or raise "
      "--distributed_timeout"
  )
  assert not (tmp_path / "metrics.jsonl").exists()
