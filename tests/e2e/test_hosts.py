"""Multi-host start-up: jax.distributed from the environment, and the same plan on every process."""

import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest

import bv_sharding as bvs
from bv_sharding import fingerprint
from trainers import distributed, launch

ROOT = pathlib.Path(__file__).resolve().parents[2]
SLURM = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")


def slurm_env(process: int, port: int) -> dict:
  """What `srun -n 2` sets for task `process` on this host (jax's SLURM detection reads these)."""
  values = ("7", "127.0.0.1", "2", str(process), str(process))
  return {
      **os.environ,
      **dict(zip(SLURM, values)),
      "JAX_COORDINATOR_PORT": str(port),
      "JAX_PLATFORMS": "cpu",
  }


@pytest.mark.timeout(240)
def test_processes_with_different_configs_stop_naming_the_first_differing_leaf(tmp_path):
  """Two SLURM-style tasks, no coordinator flags: jax.distributed starts from the environment,
  and process 1 (another optimizer) makes both stop before allocating, naming the leaf."""
  port = launch.free_port()
  common = [
      "--config=configs/lm.py",
      "--devices_per_process=4",
      "--config.batch_size=16",
      "--config.seq_len=64",
  ]
  procs = [
      subprocess.Popen(
          [
              sys.executable,
              "-m",
              "trainers.train",
              f"--workdir={tmp_path / str(i)}",
              *common,
              *extra,
          ],
          cwd=ROOT,
          env=slurm_env(i, port),
          stdout=subprocess.PIPE,
          stderr=subprocess.STDOUT,
          text=True,
      )
      for i, extra in enumerate([[], ["--config.optax_name=lion"]])
  ]
  outs = [p.communicate(timeout=200)[0] for p in procs]
  for i, (p, out) in enumerate(zip(procs, outs)):
    assert p.returncode != 0, out[-2000:]
    assert "jax.distributed: auto-detected slurm" in out, out[-2000:]
    assert f"process {i} of 2, 8 devices (4 here)" in out
    assert f"process {i} and process {1 - i} computed different sharding plans" in out
    assert "first at leaf #" in out and "opt/" in out.split("first at leaf #")[1][:200]
    assert "initialising params" not in out  # Stopped before allocating.


def test_cluster_detection_reads_the_environment(monkeypatch):
  for name in SLURM:
    monkeypatch.delenv(name, raising=False)
  assert distributed.detected_cluster() is None
  assert distributed.start(None, 1, 0, auto=True) == "single process"
  for name, value in zip(SLURM, ("7", "node[001-002]", "2", "1", "0")):
    monkeypatch.setenv(name, value)
  assert distributed.detected_cluster() == "slurm"
  assert distributed.start(None, 1, 0, auto=False) == "single process"  # --nodistributed_auto


def test_fingerprint_is_names_shapes_dtypes_specs_and_mesh():
  tree = {"w": jax.ShapeDtypeStruct((64, 32), "float32")}
  mesh = bvs.make_abstract_mesh([("data", 8)], 8)
  sharded = bvs.plan(tree, 'fsdp(axis="data", min_size_to_shard_mb=0)', mesh)
  whole = bvs.plan(tree, "replicate()", mesh)
  assert fingerprint.digest(sharded) == fingerprint.digest(
      bvs.plan(tree, 'shard_dim(axis="data", dim=0)', mesh)
  )  # The same specs by another strategy: the same plan (the why notes do not count).
  assert fingerprint.digest(sharded) != fingerprint.digest(whole)
  other_mesh = bvs.make_abstract_mesh([("data", 4), ("model", 2)], 8)
  assert fingerprint.describe(bvs.plan(tree, "replicate()", other_mesh))[1:] == (
      fingerprint.describe(whole)[1:]
  )
  rows = np.array([[1, 2, 3], [1, 2, 3], [1, 5, 3]])
  assert fingerprint.first_difference(rows, 0) == (2, 1)
  assert fingerprint.first_difference(rows, 2) == (0, 1)
