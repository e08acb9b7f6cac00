"""trainers/distributed.py: jax.distributed starts where the environment names a cluster."""

from tests.helpers import SLURM
from trainers import distributed


def test_cluster_detection_reads_the_environment(monkeypatch):
  for name in SLURM:
    monkeypatch.delenv(name, raising=False)
  assert distributed.detected_cluster() is None
  assert distributed.start(None, 1, 0, auto=True) == "single process"
  for name, value in zip(SLURM, ("7", "node[001-002]", "2", "1", "0")):
    monkeypatch.setenv(name, value)
  assert distributed.detected_cluster() == "slurm"
  assert distributed.start(None, 1, 0, auto=False) == "single process"  # --nodistributed_auto
