"""Plans: first-match strategies, root-independent names, tree structure, meshes, jit."""

import collections
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import bv_sharding as bvs
from benchmarks.shapes import sds
from trainers import steps

MESH = bvs.make_abstract_mesh([("data", 4), ("model", 2)], 8)


class MLP(nn.Module):

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(1024, name="up")(x)
    x = nn.LayerNorm(name="norm")(x)
    return nn.Dense(512, name="down")(x)


def mlp_shapes():
  return jax.eval_shape(MLP().init, jax.random.key(0), jnp.ones((2, 512)))["params"]


def test_first_matching_entry_wins_and_uses_fullmatch():
  tree = {"a": {"kernel": sds(512, 1024)}, "b": {"kernel": sds(512, 1024)}}
  strategy = [
      ("a/.*", 'shard_dim(axis="model", dim=0)'),
      ("a/kernel", "replicate()"),
      ("kernel", "replicate()"),
      (".*", 'fsdp(axis="data", min_size_to_shard_mb=0)'),
  ]
  mesh = bvs.make_abstract_mesh([("data", 4), ("model", 2)], 8)
  # 'kernel' claims nothing: it fullmatches neither leaf, and plan says so.
  with pytest.warns(bvs.ShardingWarning, match=r"strategy entries \['kernel'\] match no leaf"):
    entries = {e.name: e for e in bvs.plan(tree, strategy, mesh).entries}
  assert entries["a/kernel"].spec == P("model", None)
  assert entries["a/kernel"].why.startswith("'a/.*' -> shard_dim")
  assert entries["b/kernel"].spec == P(None, "data")  # 'kernel' does not fullmatch 'b/kernel'


def test_unmatched_leaf_is_replicated_and_reported():
  with pytest.warns(bvs.ShardingWarning, match=r"strategy entries \['nothing'\] match no leaf"):
    p = bvs.plan(
        {"w": sds(1024, 1024)},
        [("nothing", "replicate()")],
        bvs.make_abstract_mesh([("data", -1)], 8),
    )
  assert p.entries[0].spec == P(None, None)
  assert "no strategy entry matches" in p.entries[0].why


def test_bare_string_means_catch_all():
  mesh = bvs.make_abstract_mesh([("data", -1)], 8)
  a = bvs.plan(mlp_shapes(), 'fsdp(axis="data", min_size_to_shard_mb=0)', mesh)
  b = bvs.plan(mlp_shapes(), [(".*", 'fsdp(axis="data", min_size_to_shard_mb=0)')], mesh)
  assert [e.spec for e in a.entries] == [e.spec for e in b.entries]


Root = collections.namedtuple("Root", "params opt_state")


def test_names_do_not_depend_on_the_root_container():
  params = mlp_shapes()
  tx = optax.adam(1e-3)
  opt = jax.eval_shape(tx.init, params)
  state = train_state.TrainState(step=0, apply_fn=None, params=params, tx=tx, opt_state=opt)
  as_dict = [n for n, _ in bvs.ops.flatten_with_names({"params": params, "opt_state": opt})[0]]
  as_named_tuple = [n for n, _ in bvs.ops.flatten_with_names(Root(params, opt))[0]]
  as_train_state = [n for n, _ in bvs.ops.flatten_with_names(state)[0] if n != "step"]
  assert sorted(as_dict) == sorted(as_named_tuple) == sorted(as_train_state)
  assert "params/up/kernel" in as_dict and "opt_state/0/mu/up/kernel" in as_dict


def test_non_string_keys_and_list_indices_in_names():
  names = [n for n, _ in bvs.ops.flatten_with_names({1: [sds(2), {"x": sds(3)}], 2: sds(4)})[0]]
  assert names == ["1/0", "1/1/x", "2"]
  assert [n for n, _ in bvs.ops.flatten_with_names({(2, 3): sds(4)})[0]] == ["(2, 3)"]


def test_none_empty_and_masked_nodes_are_preserved():
  tree = {
      "w": sds(1024, 1024),
      "none": None,
      "empty": {},
      "masked": optax.MaskedNode(),
      "state": optax.EmptyState(),
      "list": [],
  }
  shardings, specs = bvs.infer_sharding(
      tree, 'fsdp(axis="data", min_size_to_shard_mb=0)', bvs.make_mesh([("data", -1)])
  )
  assert jax.tree.structure(specs) == jax.tree.structure(jax.tree.map(lambda x: 0, tree))
  assert specs["none"] is None and specs["masked"] == optax.MaskedNode() and specs["list"] == []
  assert specs["w"] == P(None, "data")
  assert isinstance(shardings["w"], NamedSharding)


def test_boxed_params_come_out_unboxed():
  class Boxed(nn.Module):

    @nn.compact
    def __call__(self, x):
      return nn.Dense(
          1024,
          kernel_init=nn.with_logical_partitioning(
              nn.initializers.lecun_normal(), ("embed", "mlp")
          ),
      )(x)

  abstract = jax.eval_shape(Boxed().init, jax.random.key(0), jnp.ones((1, 512)))
  mesh = bvs.make_mesh([("data", 4), ("model", 2)])
  strategy = [(".*kernel", "logical_partitioning()"), (".*", "replicate()")]
  shardings, specs = bvs.infer_sharding(
      abstract, strategy, mesh, rules=[("embed", "data"), ("mlp", "model")]
  )
  assert jax.tree.structure(specs) == jax.tree.structure(nn.unbox(abstract))
  assert specs["params"]["Dense_0"]["kernel"] == P("data", "model")


def test_jit_init_with_inferred_shardings_places_every_array_as_planned():
  mesh = bvs.make_mesh([("data", -1), ("model", 2)])
  strategy = [
      (
          ".*up/kernel",
          'shard_dim(axis="model", dim=-1)|fsdp(axis="data", ' "min_size_to_shard_mb=0)",
      ),
      (".*", 'fsdp(axis="data", min_size_to_shard_mb=0)'),
  ]
  init = lambda rng: MLP().init(rng, jnp.ones((2, 512)))
  abstract = jax.eval_shape(init, jax.random.key(0))
  shardings, specs = bvs.infer_sharding(abstract, strategy, mesh)
  variables = jax.jit(init, out_shardings=shardings)(jax.random.key(0))
  for (name, array), (_, sharding) in zip(
      bvs.ops.flatten_with_names(variables)[0], bvs.ops.flatten_with_names(shardings)[0]
  ):
    assert array.sharding.is_equivalent_to(sharding, array.ndim), name
  up = variables["params"]["up"]["kernel"]
  assert specs["params"]["up"]["kernel"] == P("data", "model")
  assert up.addressable_shards[0].data.shape == (128, 512)


def test_abstract_mesh_plans_a_pod_without_devices():
  mesh = bvs.make_abstract_mesh([("data", -1), ("model", 8)], 256)
  tree = {"embedding": sds(32000, 4096), "q_kernel": sds(32, 4096, 4096), "scale": sds(32, 4096)}
  p = bvs.plan(tree, 'tensor_parallel(axis="model")|fsdp(axis="data")', mesh)
  specs = {e.name: e.spec for e in p.entries}
  assert specs["q_kernel"] == P(None, "data", "model")
  assert specs["embedding"] == P("model", "data")
  assert p.num_devices == 256
  assert p.entries[1].bytes_per_device == 32 * 4096 * 4096 * 4 // 256
  assert p.shardings["embedding"].mesh is mesh


def test_bytes_per_device_and_report():
  mesh = bvs.make_abstract_mesh([("data", 4), ("model", 2)], 8)
  tree = {"big": sds(1024, 1024), "tiny": sds(3)}
  p = bvs.plan(tree, 'fsdp(axis="data", min_size_to_shard_mb=1)', mesh)
  assert p.total_bytes == 1024 * 1024 * 4 + 12
  assert p.bytes_per_device == 1024 * 1024 + 12
  # Split 4 ways of the 8 devices (data only): half of the ideal split for its bytes.
  assert p.coverage == pytest.approx(1024 * 1024 * 4 * (4 / 8) / p.total_bytes)
  report = p.report()
  lines = report.splitlines()
  assert lines[0].split()[:5] == ["name", "shape", "dtype", "spec", "MiB/device"]
  assert "big" in lines[1] and "P(None, 'data')" in lines[1] and "1.000" in lines[1]
  assert "4.00 MiB in all" in report and "unsharded: tiny" in report


def test_a_state_plan_reuses_the_params_plan_it_is_given():
  mesh = bvs.make_abstract_mesh([("data", 4), ("model", 2)], 8)
  strategy = [("params/up/.*", 'shard_dim(axis="model", dim=-1)'), (".*", 'fsdp(axis="data")')]
  params = mlp_shapes()
  tree = {"params": params, "opt": jax.eval_shape(optax.adam(1e-3).init, params)}
  alone = bvs.plan({"params": params}, strategy, mesh)
  both = bvs.plan(tree, strategy, mesh, params=alone)
  reused = [e for e in both.entries if e.name.startswith("params/")]
  assert all(a is b for a, b in zip(alone.entries, reused, strict=True))  # not decided again
  assert both.entries == bvs.plan(tree, strategy, mesh).entries
  with pytest.raises(bvs.ShardingError, match="planned with strategy"):
    bvs.plan(tree, 'fsdp(axis="data")', mesh, params=alone)
  explicit = bvs.make_abstract_mesh([("data", 4), ("model", 2)], 8, axis_types="explicit")
  with pytest.raises(bvs.ShardingError, match=r"axis types \{'data': 'auto'.* plan on a mesh"):
    bvs.plan(tree, strategy, explicit, params=alone)
  with pytest.raises(bvs.ShardingError, match="not this tree's 2 params"):
    bvs.plan({"params": {"up": params["up"]}}, strategy, mesh, params=alone)
  with pytest.raises(
      bvs.ShardingError, match=r"under rules \[\], .* under \[\('batch', 'data'\)\]"
  ):
    bvs.plan(tree, strategy, mesh, rules=[("batch", "data")], params=alone)
  with nn.logical_axis_rules([("batch", "data")]):  # The enclosing rules count as well.
    with pytest.raises(bvs.ShardingError, match="same strategy, mesh and rules"):
      bvs.plan(tree, strategy, mesh, params=alone)
    ruled = bvs.plan({"params": params}, strategy, mesh)
    assert bvs.plan(tree, strategy, mesh, params=ruled).rules == (("batch", "data"),)


@pytest.mark.parametrize(
    "strategy, rules, fragments",
    [
        ('fsdp(axis="modle")', None, ["no axis 'modle'", "['data', 'model']"]),
        ([("(", "replicate()")], None, ["regex '(' does not compile"]),
        ([(".*",)], None, ["list of (regex, op_chain) pairs"]),
        (42, None, ["list of (regex, op_chain) pairs"]),
        ([(3, "replicate()")], None, ["regex must be a string"]),
        ([(".*", 'tensor_parallel(axis=("model", "x"))')], None, ["no axis 'x'"]),
        ("logical_partitioning()", [("embed", "nope")], ["sharding_rules entry", "no axis 'nope'"]),
        ("logical_partitioning()", "embed", ["sharding_rules must be a list"]),
        ([(".*", "nope()")], None, ["unknown op 'nope'"]),
        ([], None, ["sharding_strategy is empty", "replicate()"]),
        ('fsdp(axis="data", min_size_to_shard_mb=1e999)', None, ["finite number >= 0, got inf"]),
    ],
)
def test_plan_errors_name_the_offender(strategy, rules, fragments):
  mesh = bvs.make_abstract_mesh([("data", 4), ("model", 2)], 8)
  with pytest.raises(bvs.ShardingError) as info:
    bvs.plan({"w": sds(8, 8)}, strategy, mesh, rules=rules)
  for fragment in fragments:
    assert fragment in str(info.value), str(info.value)


def test_boxed_mesh_axis_missing_from_mesh_is_an_error():
  tree = {"w": nn.Partitioned(sds(8, 8), ("tensor", None))}
  with pytest.raises(bvs.ShardingError, match="leaf 'w': the mesh has no axis 'tensor'"):
    bvs.plan(tree, "logical_partitioning()", bvs.make_abstract_mesh([("data", -1)], 8))


@pytest.mark.parametrize("mesh", [[("data", 8)], (("data", -1),), {"data": 8}, None])
def test_plan_needs_a_mesh_not_a_config_mesh(mesh):
  with pytest.raises(bvs.ShardingError, match=r"mesh must be a jax Mesh .* bvs\.make_mesh"):
    bvs.plan({"w": sds(8, 8)}, 'fsdp(axis="data")', mesh)


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


@pytest.mark.parametrize(
    "leaf, kind", [("hello", "a str ('hello')"), (print, "a builtin_function")]
)
def test_a_leaf_that_is_not_an_array_is_named(leaf, kind):
  with pytest.raises(bvs.ShardingError, match=rf"leaf 'opt/0' is {re.escape(kind)}"):
    bvs.plan({"w": sds(8, 8), "opt": [leaf]}, "replicate()", MESH)


def test_a_tree_too_deep_is_refused_and_the_process_plans_on():
  """5000 nested dicts would end in jax's recursive flattening, which can leave the process
  unable to flatten anything afterwards; the depth is checked first, without recursion."""
  deep = sds(8)
  for _ in range(5000):
    deep = {"a": deep}
  with pytest.raises(bvs.ShardingError, match="nests deeper than 500 levels"):
    bvs.plan(deep, "replicate()", MESH)
  assert bvs.plan({"w": sds(8, 8)}, "replicate()", MESH).specs == {"w": P(None, None)}


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
  explicit = bvs.make_mesh([("data", -1)], axis_types="explicit")  # Same devices, other types.
  b = jax.device_put(state["b"], NamedSharding(explicit, plan.shardings["b"].spec))
  assert plan.mismatches({**state, "b": b}) == [
      "b: a mesh with axis types {'data': 'explicit'}, not the plan's {'data': 'auto'} (specs of "
      "optimizer statistics depend on them); plan on a mesh of the types you run on, e.g. "
      'bvs.make_abstract_mesh(config.mesh, n, axis_types="explicit")'
  ]
  with pytest.raises(bvs.ShardingError, match=r"after init: 1 arrays .*b: missing from the tree"):
    steps.check_state(plan, {"a": state["a"]}, "after init")
