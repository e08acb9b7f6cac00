"""Every built-in op on single leaves, through plans on an abstract 4x2 mesh."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

import bv_sharding as bvs
from benchmarks.shapes import sds
from bv_sharding.specs import MiB

MESH = bvs.make_abstract_mesh([("data", 4), ("model", 2)], 8)
MiB_F32 = MiB // 4  # float32 elements in one MiB


def spec_of(tree, strategy, name, **kw):
  """(spec without trailing Nones, why) of leaf ``name``."""
  entries = {e.name: e for e in bvs.plan(tree, strategy, MESH, **kw).entries}
  spec = list(entries[name].spec)
  while spec and spec[-1] is None:
    spec.pop()
  return tuple(spec), entries[name].why


def test_replicate():
  assert spec_of({"w": sds(1024, 1024)}, "replicate()", "w")[0] == ()


def test_fsdp_largest_divisible_dim_and_threshold():
  tree = {"big": sds(512, 4096), "small": sds(4, 8), "odd": sds(1023, 1025)}
  assert spec_of(tree, 'fsdp(axis="data")', "big")[0] == (None, "data")
  spec, why = spec_of(tree, 'fsdp(axis="data")', "small")
  assert spec == () and "MiB threshold" in why
  spec, why = spec_of(tree, 'fsdp(axis="data", min_size_to_shard_mb=0)', "odd")
  assert spec == () and "no free dim" in why


def test_fsdp_tie_prefers_last_dim_and_skips_taken_dim():
  tree = {"w": sds(2048, 2048)}
  assert spec_of(tree, 'fsdp(axis="data")', "w")[0] == (None, "data")
  chain = 'shard_dim(axis="model", dim=1)|fsdp(axis="data")'
  assert spec_of(tree, chain, "w")[0] == ("data", "model")


def test_fsdp_tuple_axis_uses_product_of_sizes():
  tree = {"w": sds(1024, 1028)}  # 1028 % 8 != 0, 1024 % 8 == 0
  assert spec_of(tree, 'fsdp(axis=("data", "model"))', "w")[0] == (("data", "model"),)


def test_fsdp_never_uses_an_axis_twice():
  spec, why = spec_of(
      {"w": sds(2048, 2048)}, 'shard_dim(axis="data", dim=0)|fsdp(axis="data")', "w"
  )
  assert spec == ("data",) and "already used" in why


@pytest.mark.parametrize(
    "dim, expected",
    [(0, ("model",)), (-1, (None, None, "model")), (-3, ("model",)), (1, (None, "model"))],
)
def test_shard_dim_negative_dims(dim, expected):
  tree = {"w": sds(8, 8, 8)}
  assert spec_of(tree, f'shard_dim(axis="model", dim={dim})', "w")[0] == expected


def test_shard_dim_indivisible_is_recorded_or_a_strict_error():
  tree = {"w": sds(6, 8)}
  spec, why = spec_of(tree, 'shard_dim(axis="data", dim=0)', "w")
  assert spec == () and "not divisible" in why
  with pytest.raises(bvs.ShardingError, match=r"'w' \(6, 8\): dim 0 \(6\) not divisible"):
    bvs.plan(tree, 'shard_dim(axis="data", dim=0)', MESH, strict=True)


def test_strict_fsdp_raises_only_for_big_indivisible_leaves():
  with pytest.raises(bvs.ShardingError, match="no free dim"):
    bvs.plan({"w": sds(2047, 1025)}, 'fsdp(axis="data")', MESH, strict=True)
  bvs.plan({"w": sds(3, 5)}, 'fsdp(axis="data")', MESH, strict=True)  # too small: fine


LLAMA = {
    "embed": {"embedding": sds(4096, 512)},
    "layers": {
        "attn": {"q_kernel": sds(512, 512), "out_kernel": sds(512, 1024)},
        "mlp": {
            "up_kernel": sds(512, 2048),
            "down_kernel": sds(2048, 512),
            "other": sds(1024, 512),
        },
        "norm": {"scale": sds(4096, 512)},
        "upscale_conv": {"kernel": sds(512, 1024)},
    },
    "scanned": {"q_kernel": sds(32, 512, 512), "mlp": sds(32, 512, 1024), "bias": sds(512, 512)},
}


@pytest.mark.parametrize(
    "name, expected",
    [
        ("embed/embedding", (None, "data")),
        ("layers/attn/q_kernel", ("data",)),
        ("layers/attn/out_kernel", (None, "data")),
        ("layers/mlp/up_kernel", ("data",)),
        ("layers/mlp/down_kernel", (None, "data")),
        ("layers/mlp/other", ("data",)),
        ("layers/norm/scale", ()),
        ("layers/upscale_conv/kernel", (None, "data")),  # not a `scale`
        ("scanned/q_kernel", (None, "data")),  # dim -2, layer axis untouched
        ("scanned/mlp", (None, None, "data")),  # last two dims only
        ("scanned/bias", ()),
    ],
)
def test_llm_fsdp_name_rules(name, expected):
  assert spec_of(LLAMA, 'llm_fsdp(axis="data")', name)[0] == expected


def test_llm_fsdp_small_and_1d_leaves_are_not_sharded():
  tree = {"w": sds(64, 64), "v": sds(4 * MiB_F32)}
  assert "threshold" in spec_of(tree, 'llm_fsdp(axis="data")', "w")[1]
  assert "fewer than 2 dims" in spec_of(tree, 'llm_fsdp(axis="data")', "v")[1]


@pytest.mark.parametrize(
    "name, expected",
    [
        ("embed/embedding", ("model", "data")),
        ("layers/attn/q_kernel", ("data", "model")),
        ("layers/attn/out_kernel", ("model", "data")),
        ("layers/mlp/up_kernel", ("data", "model")),
        ("layers/mlp/down_kernel", ("model", "data")),
        ("layers/norm/scale", ("data",)),
        ("scanned/q_kernel", (None, "data", "model")),
    ],
)
def test_tensor_parallel_composes_with_fsdp(name, expected):
  chain = 'tensor_parallel(axis="model")|fsdp(axis="data", min_size_to_shard_mb=0)'
  assert spec_of(LLAMA, chain, name)[0] == expected


def test_tensor_parallel_leaves_other_leaves_alone():
  spec, why = spec_of(LLAMA, 'tensor_parallel(axis="model")', "layers/mlp/other")
  assert spec == () and "not a tensor-parallel kernel" in why


class Boxed(nn.Module):

  @nn.compact
  def __call__(self, x):
    kernel = self.param(
        "kernel",
        nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp")),
        (x.shape[-1], 64),
    )
    table = self.param(
        "table", nn.with_partitioning(nn.initializers.zeros, ("model", None)), (16, 8)
    )
    odd = self.param("odd", nn.with_logical_partitioning(nn.initializers.zeros, ("mlp",)), (6,))
    return x @ kernel + table.sum() + odd.sum()


def boxed_tree():
  return jax.eval_shape(Boxed().init, jax.random.key(0), jnp.ones((1, 32)))


def test_logical_partitioning_resolves_rules_with_fallbacks():
  rules = [("embed", "data"), ("mlp", "data"), ("mlp", "model")]
  tree = boxed_tree()
  assert spec_of(tree, "logical_partitioning()", "params/kernel", rules=rules)[0] == (
      "data",
      "model",
  )
  assert spec_of(tree, "logical_partitioning()", "params/table", rules=rules)[0] == ("model",)
  spec, why = spec_of(tree, "logical_partitioning()", "params/odd", rules=rules)
  assert spec == () and "not divisible" in why


def test_logical_partitioning_on_unboxed_leaf_is_recorded():
  spec, why = spec_of({"w": sds(8, 8)}, "logical_partitioning()", "w")
  assert spec == () and "not a boxed param" in why


def test_preconditioner_and_zero1_leave_params_alone():
  spec, why = spec_of({"w": sds(1024, 1024)}, 'zero1(axis="data")', "w")
  assert spec == () and "zero1 shards state" in why
  spec, why = spec_of({"w": sds(1024, 1024)}, 'preconditioner(axis="data")', "w")
  assert spec == () and "acts on state" in why


@pytest.mark.parametrize("op", ["fsdp", "llm_fsdp"])
def test_threshold_boundary_fsdp_is_big_visions_strict_llm_fsdp_the_seeds_inclusive(op):
  exactly = {"w": sds(1024, 1024)}  # exactly 4 MiB
  above = {"w": sds(1024, 1025)}
  chain = f'{op}(axis="data", min_size_to_shard_mb=4)'
  spec, why = spec_of(exactly, chain, "w")
  if op == "fsdp":  # big_vision: size <= min_size_to_shard_mb stays unsharded
    assert spec == () and "<= 4 MiB threshold" in why
  else:
    assert spec == (None, "data")
  assert spec_of(above, chain, "w")[0] == ("data",)


def test_fsdp_ties_take_the_last_of_equal_dims_as_big_vision():
  tree = {"w": sds(3, 2048, 2048), "v": sds(2048, 7, 2048)}
  assert spec_of(tree, 'fsdp(axis="data")', "w")[0] == (None, None, "data")
  assert spec_of(tree, 'fsdp(axis="data")', "v")[0] == (None, None, "data")


@pytest.mark.parametrize(
    "strategy",
    [
        "replicate",
        [(".*", "replicate")],  # big_vision's default sharding_strategy
        [(".*FREEZE_ME.*", "replicate"), (".*", 'fsdp(axis="data")')],
        [(".*", 'shard_dim("model", 0) | replicate')],
    ],
)
def test_bare_op_names_are_calls_without_arguments(strategy):
  tree = {"FREEZE_ME": {"w": sds(2048, 2048)}}
  assert spec_of(tree, strategy, "FREEZE_ME/w")[0] == ()


def test_replicate_after_another_op_replaces_its_axes():
  spec, why = spec_of({"w": sds(2048, 2048)}, 'fsdp(axis="data")|replicate()', "w")
  assert spec == () and why.endswith("replicate: replicated")


def test_shard_dim_out_of_range_raises_unless_ignore_ndim_error_as_big_vision():
  tree = {"w": sds(6, 8), "b": sds(8)}
  with pytest.raises(bvs.ShardingError, match=r"leaf 'b' \(8,\) has no dim -2") as info:
    bvs.plan(tree, 'shard_dim(axis="model", dim=-2)', MESH)
  assert "ignore_ndim_error=True" in str(info.value)
  for chain in (
      'shard_dim(axis="model", dim=-2, ignore_ndim_error=True)',
      'shard_dim("model", -2, True)',  # positional, as big_vision's registry accepts
  ):
    assert spec_of(tree, chain, "w")[0] == ("model",)
    spec, why = spec_of(tree, chain, "b")
    assert spec == () and "ignore_ndim_error" in why
  with pytest.raises(bvs.ShardingError, match="ignore_ndim_error must be True or False"):
    bvs.parse_chain('shard_dim("model", 0, ignore_ndim_error="yes")')
