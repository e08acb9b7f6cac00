"""Coverage: bytes split over the whole mesh, the gate, and which strategy entries claim leaves."""

import pytest

import bv_sharding as bvs
from benchmarks.shapes import sds
from bv_sharding import coverage

MESH = bvs.make_abstract_mesh([("data", 4), ("model", 2)], 8)
TREE = {"both": sds(64, 64), "data_only": sds(64, 64), "whole": sds(64, 64)}
STRATEGY = [
    ("both", 'shard_dim(axis="data", dim=0)|shard_dim(axis="model", dim=1)'),
    ("data_only", 'shard_dim(axis="data", dim=0)'),
    ("bias", "replicate()"),  # Claims nothing: a typo for a leaf that does not exist.
]


def planned() -> bvs.Plan:
  """The plan of ``TREE`` by ``STRATEGY``, whose typo ``plan`` points out."""
  with pytest.warns(bvs.ShardingWarning, match=r"strategy entries \['bias'\] match no leaf"):
    return bvs.plan(TREE, STRATEGY, MESH)


def test_coverage_counts_the_share_of_every_mesh_axis():
  plan = planned()
  # both: 8 of 8 pieces, data_only: 4 of 8, whole: 1 of 8; equal sizes.
  assert plan.coverage == pytest.approx((1 + 4 / 8 + 1 / 8) / 3)
  assert coverage.unsharded_fraction(plan) == pytest.approx(1 - plan.coverage)
  assert [e.name for e in coverage.least_sharded(plan)] == ["whole", "data_only"]
  assert [plan.pieces(e) for e in plan.entries] == [8, 4, 1]
  assert plan.unsharded_bytes(plan.by_name()["data_only"]) == 64 * 64 * 4 / 2


def test_gate_passes_at_the_limit_and_names_leaves_above_it():
  plan = planned()
  bvs.check_coverage(plan, coverage.unsharded_fraction(plan))
  with pytest.raises(bvs.ShardingError) as info:
    bvs.check_coverage(plan, 0.1)
  message = str(info.value)
  assert "45.8% of the planned bytes" in message and "max_unsharded_fraction=0.1" in message
  assert "whole (64, 64)" in message and "data_only (64, 64)" in message and "both" not in message
  with pytest.raises(bvs.ShardingError, match="a number in \\[0, 1\\]"):
    bvs.check_coverage(plan, 2)


def test_claims_name_unused_entries_and_unclaimed_leaves():
  plan = planned()
  assert plan.claims() == ([("bias", "replicate()")], ["whole"])
  assert bvs.plan(TREE, [(".*", "replicate()")], MESH).claims() == ([], [])
