"""``logical_partitioning()`` against flax's own resolver, with the rule lists other projects ship.

The rule lists are copied as data (their targets written exactly as there: lists,
empty lists, ``None``): MaxText's ``MaxText/configs/base.yml``
``logical_axis_rules`` (AI-Hypercomputer/maxtext at 000e93554a02) and T5X's
``standard_logical_axis_rules`` for each partitioning-dims setting
(google-research/t5x, ``t5x/partitioning.py``). Every leaf's spec must be what
``nn.logical_to_mesh_axes`` gives, on every dim the axis divides; a dim it does
not divide stays unsharded (docs/differences.md).
Test meshes carry every mesh axis the rules name, at size 1 where unused.
"""

import itertools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

import bv_sharding as bvs

MAXTEXT_BASE_RULES = [
    ["activation_batch", ["data", "fsdp", "fsdp_transpose"]],
    ["activation_heads", ["tensor", "sequence"]],
    ["activation_length", "sequence"],
    ["activation_embed", "tensor"],
    ["activation_mlp", "tensor"],
    ["activation_kv", "tensor"],
    ["activation_vocab", ["tensor", "sequence"]],
    ["activation_vocab", "tensor"],
    ["activation_vocab", "sequence"],
    ["mlp", ["fsdp_transpose", "tensor", "autoregressive"]],
    ["vocab", ["tensor", "autoregressive"]],
    ["embed", ["fsdp", "fsdp_transpose", "sequence"]],
    ["embed", ["fsdp", "sequence"]],
    ["norm", "tensor"],
    ["heads", ["tensor", "autoregressive"]],
    ["kv", []],
    ["cache_batch", []],
    ["cache_heads", ["autoregressive", "tensor"]],
    ["cache_kv", []],
    ["cache_sequence", []],
]
MAXTEXT_AXES = ("data", "fsdp", "fsdp_transpose", "sequence", "tensor", "autoregressive")

_T5X_REPLICATED = [
    ("relpos_buckets", None),
    ("abspos_buckets", None),
    ("length", None),
    ("layers", None),
    ("stack", None),
    ("mlp_activations", None),
]
_T5X_HEAD = [
    ("batch", "data"),
    ("vocab", "model"),
    ("mlp", "model"),
    ("heads", "model"),
    ("kv", None),
    ("joined_kv", "model"),
]
T5X_RULES = {  # (activation_partitioning_dims, parameter_partitioning_dims) -> rules
    (1, 1): [
        ("batch", "data"),
        ("vocab", "model"),
        ("embed", None),
        ("mlp", "model"),
        ("heads", "model"),
        ("kv", None),
        ("joined_kv", "model"),
    ]
    + _T5X_REPLICATED,
    (2, 1): _T5X_HEAD + [("embed", "model")] + _T5X_REPLICATED,
    (1, 2): _T5X_HEAD + [("embed", "data")] + _T5X_REPLICATED,
    (2, 2): _T5X_HEAD + [("embed", "model"), ("embed", "data")] + _T5X_REPLICATED,
}
FALLBACK_RULES = [
    ("embed", "data"),
    ("embed", "model"),
    ("mlp", "data"),
    ("heads", ("data", "model")),
]

CASES = {
    "maxtext_16": (MAXTEXT_BASE_RULES, dict(zip(MAXTEXT_AXES, (2, 2, 1, 1, 2, 2)))),
    "maxtext_256": (MAXTEXT_BASE_RULES, dict(zip(MAXTEXT_AXES, (1, 16, 2, 2, 4, 1)))),
    **{
        f"t5x_{a}{p}_{n}": (rules, {"data": n // m, "model": m})
        for (a, p), rules in T5X_RULES.items()
        for n, m in ((8, 2), (256, 8))
    },
    "fallback_8": (FALLBACK_RULES, {"data": 4, "model": 2}),
}


def _norm(spec, ndim):
  entries = [None if not e else ((e,) if isinstance(e, str) else tuple(e)) for e in spec]
  return tuple(entries + [None] * (ndim - len(entries)))


def _names(rules):
  logical = sorted({name for name, _ in rules})
  return logical + [None, "not_in_rules"]


def _boxed_tree(rules, dim_size):
  """One boxed leaf per ordered pair and a sample of triples of the rules' logical names."""
  names = _names(rules)
  combos = [(n,) for n in names]
  combos += [c for c in itertools.permutations(names, 2) if c.count(None) < 2]
  combos += [c for c in itertools.permutations(names, 3) if None not in c][::7]
  return {
      f"w{i}": nn.LogicallyPartitioned(
          jax.ShapeDtypeStruct((dim_size,) * len(c), jnp.float32), names=c
      )
      for i, c in enumerate(combos)
  }


def _check_against_flax(plan, tree, rules, sizes):
  entries = plan.by_name()
  checked = 0
  for name, box in tree.items():
    shape = box.value.shape
    theirs = _norm(nn.logical_to_mesh_axes(box.names, rules), len(shape))
    mine = _norm(entries[name].spec, len(shape))
    for d, axes in enumerate(theirs):
      divides = axes is None or shape[d] % math.prod(sizes[a] for a in axes) == 0
      assert mine[d] == (axes if divides else None), (name, box.names, theirs, mine)
      checked += axes is not None and divides
  return checked


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("dim_size", [64, 6])
def test_rules_from_the_flax_context_plan_as_flax_resolves_them(case, dim_size):
  rules, sizes = CASES[case]
  mesh = bvs.make_abstract_mesh(list(sizes.items()), math.prod(sizes.values()))
  tree = _boxed_tree(rules, dim_size)
  with nn.logical_axis_rules(rules):
    plan = bvs.plan(tree, "logical_partitioning()", mesh)  # rules=None: the context's
  checked = _check_against_flax(plan, tree, rules, sizes)
  if dim_size == 64:
    assert checked > len(tree) // 2


@pytest.mark.parametrize("case", ["maxtext_16", "t5x_22_256", "fallback_8"])
def test_explicit_rules_plan_as_flax_and_win_over_the_context(case):
  rules, sizes = CASES[case]
  mesh = bvs.make_abstract_mesh(list(sizes.items()), math.prod(sizes.values()))
  tree = _boxed_tree(rules, 64)
  other = [(name, None) for name, _ in rules]  # a context that would replicate everything
  with nn.logical_axis_rules(other):
    plan = bvs.plan(tree, "logical_partitioning()", mesh, rules=rules)
  assert _check_against_flax(plan, tree, rules, sizes) > len(tree) // 2


def test_empty_list_target_means_none_and_blocks_later_fallbacks():
  mesh = bvs.make_abstract_mesh([("data", 4), ("model", 2)], 8)
  tree = {"w": nn.LogicallyPartitioned(jax.ShapeDtypeStruct((8, 8), jnp.float32), ("kv", "mlp"))}
  rules = [["kv", []], ["kv", "data"], ["mlp", ["model"]]]
  assert nn.logical_to_mesh_axes(("kv", "mlp"), rules) == jax.sharding.PartitionSpec(None, "model")
  plan = bvs.plan(tree, "logical_partitioning()", mesh, rules=rules)
  assert _norm(plan.entries[0].spec, 2) == (None, ("model",))


def test_without_any_rules_the_plan_says_how_to_pass_them():
  mesh = bvs.make_abstract_mesh([("data", 8)], 8)
  tree = {"w": nn.LogicallyPartitioned(jax.ShapeDtypeStruct((8, 8), jnp.float32), ("a", "b"))}
  entry = bvs.plan(tree, "logical_partitioning()", mesh).entries[0]
  assert entry.spec == jax.sharding.PartitionSpec(None, None)
  assert "nn.logical_axis_rules" in entry.why and "rules=" in entry.why


def test_context_rules_naming_a_missing_mesh_axis_raise_naming_the_context():
  mesh = bvs.make_abstract_mesh([("data", 8)], 8)
  tree = {"w": nn.LogicallyPartitioned(jax.ShapeDtypeStruct((8, 8), jnp.float32), ("a", "b"))}
  with nn.logical_axis_rules([("a", "tensor")]):
    with pytest.raises(bvs.ShardingError, match="nn.logical_axis_rules context.*'tensor'"):
      bvs.plan(tree, "logical_partitioning()", mesh)
