"""The library checks its arguments at the boundary: each mistake is a ShardingError naming it."""

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import bv_sharding as bvs
from benchmarks.shapes import sds
from bv_sharding import patterns, registry
from trainers import steps

MESH = bvs.make_abstract_mesh([("data", 4), ("model", 2)], 8)


@pytest.mark.parametrize("mesh", [[("data", 8)], (("data", -1),), {"data": 8}, None])
def test_plan_needs_a_mesh_not_a_config_mesh(mesh):
  with pytest.raises(bvs.ShardingError, match=r"mesh must be a jax Mesh .* bvs\.make_mesh"):
    bvs.plan({"w": sds(8, 8)}, 'fsdp(axis="data")', mesh)


@pytest.mark.parametrize("count", [0, -1, -256, True, 2.5, "8", None])
def test_device_counts(count):
  with pytest.raises(bvs.ShardingError, match=r"num_devices=.*devices >= 1"):
    bvs.make_abstract_mesh([("data", -1)], count)


def test_make_mesh_on_no_devices():
  with pytest.raises(bvs.ShardingError, match=r"num_devices=0"):
    bvs.make_mesh([("data", -1)], devices=[])


@pytest.mark.parametrize("name", ["", 3, None, "two words", ("fsdp",)])
def test_register_needs_an_identifier_name(name):
  with pytest.raises(bvs.ShardingError, match=r"register: the op name"):
    bvs.register(name)
  with pytest.raises(bvs.ShardingError, match=r"unknown op 'nope'"):
    bvs.lookup("nope")  # The registry is intact: unknown ops stay our error.


@pytest.mark.parametrize("factory", [3, "fsdp", None])
def test_register_needs_a_callable(factory):
  with pytest.raises(bvs.ShardingError, match=r"register\('test_only_never'\) decorates"):
    bvs.register("test_only_never")(factory)
  assert "test_only_never" not in bvs.registered()


@bvs.register("test_only_returns")
def returns(result):
  """A rule returning `result` as given in the strategy string."""
  return lambda leaf, spec: result


@pytest.mark.parametrize(
    "result",
    [
        '("data",)',  # A spec, not (spec, note).
        '((None,), "n")',  # One entry for a 2-d leaf.
        '((None, "nope"), "n")',  # No such mesh axis.
        '(("data", "data"), "n")',  # An axis twice.
        '(("model", ("data", "model")), "n")',  # An axis twice, in a tuple.
        '((None, "data"), "n")',  # 6 is not divisible by 4.
        "((None, None), 3)",  # The note is not a string.
        '(((1,), None), "n")',  # An axis that is not a name.
        "None",
    ],
)
def test_malformed_rule_output_names_the_op(result):
  with pytest.raises(bvs.ShardingError, match=r"op 'test_only_returns' on leaf 'w' \(8, 6\)"):
    bvs.plan({"w": sds(8, 6)}, f"test_only_returns({result})", MESH)


def test_well_formed_rule_output_is_used():
  plan = bvs.plan({"w": sds(8, 6)}, 'test_only_returns((("data", "model"), "mine"))', MESH)
  assert plan.entries[0].spec == jax.sharding.PartitionSpec("data", "model")


@pytest.mark.parametrize(
    "strategy, fragment",
    [
        ({".*": 'fsdp(axis="data")'}, "sharding_strategy is a dict; write it as a list"),
        (['.*fsdp(axis="data")'], "must be a list of (regex, op_chain) pairs"),
        ([(".*", 'fsdp(axis="data")', "extra")], "must be a list of (regex, op_chain) pairs"),
        ({(".*", 'fsdp(axis="data")')}, "must be a list of (regex, op_chain) pairs"),
        (3, "must be a list of (regex, op_chain) pairs"),
    ],
)
def test_strategy_container_types(strategy, fragment):
  with pytest.raises(bvs.ShardingError) as e:
    bvs.plan({"w": sds(8, 8)}, strategy, MESH)
  assert fragment in str(e.value)


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


@pytest.fixture(scope="module")
def placed():
  mesh = bvs.make_mesh([("data", -1)])
  plan = bvs.plan({"a": sds(8, 8), "b": sds(8)}, 'fsdp(axis="data", min_size_to_shard_mb=0)', mesh)
  state = jax.tree.map(lambda s: jax.device_put(jnp.zeros((8,) * len(s.spec)), s), plan.shardings)
  return plan, state


def test_mismatches_report_a_missing_leaf(placed):
  plan, state = placed
  assert plan.mismatches(state) == []
  assert plan.mismatches({"a": state["a"]}) == ["b: missing from the tree"]
  assert plan.mismatches({**state, "c": state["b"]}) == ["c: not in the plan"]
  assert plan.mismatches({**state, "b": np.zeros(8)}) == ["b: a ndarray, not a jax.Array"]
  with pytest.raises(bvs.ShardingError, match=r"after init: 1 arrays .*b: missing from the tree"):
    steps.check_state(plan, {"a": state["a"]}, "after init")


def test_patterns_unmatched_lists_in_order():
  pats = patterns.parse_strategy(
      [("x", "replicate()"), ("w", "replicate()"), ("y", "replicate()")], {}
  )
  assert patterns.unmatched(pats, ["w"]) == ["x", "y"]
  assert "test_only_returns" in registry.registered()
