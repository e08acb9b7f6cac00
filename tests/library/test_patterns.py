"""bv_sharding/patterns.py: strategy regexes matched with a time bound, unmatched entries reported."""

import time

import pytest

import bv_sharding as bvs
from benchmarks.shapes import sds
from bv_sharding import patterns

MESH = bvs.make_abstract_mesh([("data", 4), ("model", 2)], 8)


def test_regex_time_is_bounded_and_the_error_names_it():
  tree = {"a" * 40 + "!": sds(8, 8)}
  start = time.monotonic()
  with pytest.raises(bvs.ShardingError, match=r"strategy regex '\(a\|aa\)\+\$' took over 1 s"):
    bvs.plan(tree, [("(a|aa)+$", "replicate()")], MESH)
  assert time.monotonic() - start < 30


@pytest.mark.parametrize(
    "regex",
    [
        r".*/kernel",
        r"(.*/)?(kernel|bias)",
        r"params/.*embed.*",
        r"^params/(?!.*norm).*$",
        r".*\/bias",
        r"params/(?P<layer>layers_\d+)/.*",
        r"(?i)PARAMS/.*",
    ],
)
def test_big_vision_style_regexes_still_match(regex):
  tree = {"params": {"layers_0": {"kernel": sds(8, 8), "bias": sds(8)}, "embed": sds(8, 8)}}
  plan = bvs.plan(tree, [(regex, "replicate()"), (".*", "replicate()")], MESH)
  assert any(e.why.startswith(repr(regex)) for e in plan.entries)


def test_entry_matching_no_leaf_warns_and_strict_raises():
  tree, strategy = {"w": sds(8, 8)}, [("typo_kernel", "replicate()"), (".*", "replicate()")]
  with pytest.warns(bvs.ShardingWarning, match=r"\['typo_kernel'\] match no leaf"):
    bvs.plan(tree, strategy, MESH)
  with pytest.raises(bvs.ShardingError, match=r"\['typo_kernel'\] match no leaf"):
    bvs.plan(tree, strategy, MESH, strict=True)


def test_patterns_unmatched_lists_in_order():
  pats = patterns.parse_strategy(
      [("x", "replicate()"), ("w", "replicate()"), ("y", "replicate()")], {}
  )
  assert patterns.unmatched(pats, ["w"]) == ["x", "y"]
