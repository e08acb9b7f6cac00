"""trainers/hosts/distributed.py: jax.distributed starts where the environment declares more than
one process, and a run whose cluster detection fails starts as one process, saying so;
trainers/hosts/same_job.py: two real processes that differ in one key stop before init, naming it.
"""

import pathlib
import shutil
import subprocess
import sys
from subprocess import PIPE, STDOUT

import jax
import pytest
from jax._src import clusters

from configs import lm
from tests.helpers import ROOT, SLURM, environment
from trainers import launch
from trainers.errors import ConfigError
from trainers.hosts import distributed, same_job

OMPI = (
    "OMPI_MCA_orte_hnp_uri",
    "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_LOCAL_RANK",
)
# Every variable jax's cluster detection reads without the network: none leaks in from the host.
CLUSTER_VARIABLES = (
    *SLURM,
    *OMPI,
    "TPU_WORKER_HOSTNAMES",
    "TPU_PROCESS_ADDRESSES",
    "MEGASCALE_NUM_SLICES",
    "KUBERNETES_SERVICE_HOST",
    "JAX_COORDINATOR_ADDRESS",
    "JAX_COORDINATOR_PORT",
)
# A cluster asked first whose detection raises, as GCE TPU's does with no metadata server.
UNREACHABLE = r"""
from jax._src import clusters
from trainers.hosts import distributed

class Unreachable(clusters.ClusterEnv):
  name = "unreachable"

  @classmethod
  def is_env_present(cls):
    raise ConnectionError("metadata.google.internal: no route to host\nmore")

clusters.ClusterEnv._cluster_types.insert(0, clusters.ClusterEnv._cluster_types.pop())
print(*distributed.start(None, 1, 0, auto=True), sep="\n")
"""


@pytest.fixture
def started(monkeypatch) -> list:
  """The calls of jax.distributed.initialize, which only records them; no cluster variables."""
  for name in CLUSTER_VARIABLES:
    monkeypatch.delenv(name, raising=False)
  calls = []
  monkeypatch.setattr(jax.distributed, "initialize", lambda *a, **kw: calls.append((a, kw)))
  return calls


def test_cluster_detection_reads_the_environment(started, monkeypatch):
  assert distributed.detected() == (None, 1, None)
  assert distributed.start(None, 1, 0, auto=True) == ("single process", None)
  for name, value in zip(SLURM, ("7", "node001", "8", "1", "0")):  # 8 tasks on one node.
    monkeypatch.setenv(name, value)
  assert distributed.detected() == (clusters.SlurmCluster, 8, None)
  assert distributed.start(None, 1, 0, auto=False) == ("single process", None)
  assert not started  # --nodistributed_auto


def test_a_slurm_job_of_one_task_starts_one_process(started, monkeypatch):
  for name, value in zip(SLURM, ("7", "node[001-002]", "1", "0", "0")):
    monkeypatch.setenv(name, value)
  assert distributed.start(None, 1, 0, auto=True) == ("single process", None)
  assert not started


def test_a_slurm_job_of_two_tasks_starts_jax_distributed_from_its_variables(started, monkeypatch):
  for name, value in zip(SLURM, ("7", "node[001-002]", "2", "1", "1")):
    monkeypatch.setenv(name, value)
  monkeypatch.setenv("JAX_COORDINATOR_PORT", "1234")
  assert distributed.start(None, 1, 0, auto=True, timeout=30) == ("auto-detected slurm", None)
  [(args, kwargs)] = started
  assert args == ("node001:1234", 2, 1)
  assert kwargs["initialization_timeout"] == 30 + distributed._GRACE


def test_a_gke_tpu_slice_declares_its_hosts_times_its_slices(started, monkeypatch):
  monkeypatch.setattr(clusters.GkeTpuCluster, "is_env_present", classmethod(lambda cls: True))
  monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "host-0,host-1")
  monkeypatch.setenv("MEGASCALE_NUM_SLICES", "2")
  assert distributed.detected() == (clusters.GkeTpuCluster, 4, None)


def test_an_open_mpi_job_with_an_unreadable_coordinator_stops_with_one_line(started, monkeypatch):
  for name, value in zip(OMPI, ("garbage", "2", "0", "0")):
    monkeypatch.setenv(name, value)
  with pytest.raises(ConfigError) as raised:
    distributed.start(None, 1, 0, auto=True)
  message = str(raised.value)
  assert message.startswith("ompi declares 2 processes; reading its coordinator address failed")
  assert "--coordinator_address" in message and "--nodistributed_auto" in message
  assert "\n" not in message and not started


def test_a_cluster_whose_detection_raises_starts_one_process_saying_so():
  done = subprocess.run(
      [sys.executable, "-c", UNREACHABLE],
      cwd=ROOT,
      env=environment(),
      capture_output=True,
      text=True,
      timeout=120,
  )
  assert done.returncode == 0, done.stderr
  assert done.stdout.splitlines() == [
      "single process",
      "unreachable detection failed (ConnectionError: metadata.google.internal: no route to "
      "host); started as one process. For a multi-host job give --coordinator_address, "
      "--num_processes and --process_id; --nodistributed_auto skips detection",
  ]


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
