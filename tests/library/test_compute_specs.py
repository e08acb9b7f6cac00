"""Compute specs: storage specs less the axes the placing ops declare storage-only."""

import flax.linen as nn
import jax
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import bv_sharding as bvs
from bv_sharding import ops

MESH = bvs.make_abstract_mesh([("data", 4), ("model", 2)], 8, axis_types="explicit")
KERNEL = jax.ShapeDtypeStruct((1024, 2048), np.float32)


def entry(strategy, tree=None, mesh=MESH, **kwargs) -> bvs.Entry:
  return bvs.plan(tree or {"mlp": {"up_kernel": KERNEL}}, strategy, mesh, **kwargs).entries[0]


@pytest.mark.parametrize(
    "strategy, storage, compute, gathered",
    [
        ('fsdp(axis="data")', P(None, "data"), P(None, None), "data"),
        ('fsdp(axis=("data", "model"))', P(None, ("data", "model")), P(None, None), "data, model"),
        ('llm_fsdp(axis="data")', P("data", None), P(None, None), "data"),
        ('tensor_parallel(axis="model")', P(None, "model"), P(None, "model"), None),
        ('shard_dim(axis="model", dim=0)', P("model", None), P("model", None), None),
        (
            'tensor_parallel(axis="model")|fsdp(axis="data")',
            P("data", "model"),
            P(None, "model"),
            "data",
        ),
        ('fsdp(axis="data")|replicate()', P(None, None), P(None, None), None),
        (
            'fsdp(axis="data")|replicate()|shard_dim(axis="data", dim=0)',
            P("data", None),
            P("data", None),
            None,
        ),
        ('zero1(axis="data")', P(None, None), P(None, None), None),
    ],
)
def test_compute_spec_per_builtin_op(strategy, storage, compute, gathered):
  e = entry(strategy)
  assert (e.spec, e.compute_spec) == (storage, compute)
  if gathered:
    assert e.why.endswith(f"; gathered for compute: {gathered}")
  else:
    assert "gathered" not in e.why


def test_optimizer_state_keeps_its_storage_spec():
  tree = {"params": {"w": KERNEL}, "opt": {"mu": {"w": KERNEL}}}
  p = bvs.plan(tree, 'fsdp(axis="data")|zero1(axis="model")', MESH)
  param, state = p.by_name()["params/w"], p.by_name()["opt/mu/w"]
  assert param.compute_spec == P(None, None) and state.spec == P("model", "data")
  assert state.compute_spec == state.spec and "gathered" not in state.why
  assert p.compute_specs == {
      "params": {"w": P(None, None)},
      "opt": {"mu": {"w": P("model", "data")}},
  }
  assert p.compute_shardings["params"]["w"].spec == P(None, None)


def shard_first(axis):
  return lambda leaf, spec: ops.place(leaf, spec, 0, axis)


@pytest.mark.parametrize(
    "declared, compute", [({}, P("data", None)), ({"storage_only": True}, P(None, None))]
)
def test_registered_op_keeps_its_axes_unless_declared_storage_only(declared, compute):
  with bvs.temporary_ops():
    bvs.register("shard_first", **declared)(shard_first)
    assert entry('shard_first(axis="data")').compute_spec == compute


def test_registered_op_names_the_argument_listing_its_storage_axes():
  def shard_both(storage=None):
    return lambda leaf, spec: ops.place(leaf, ops.place(leaf, spec, 0, "data")[0], 1, "model")

  with bvs.temporary_ops():
    bvs.register("shard_both", storage_only="storage")(shard_both)
    assert entry('shard_both(storage="data")').compute_spec == P(None, "model")
    assert entry('shard_both(storage=("data", "model"))').compute_spec == P(None, None)
    assert entry("shard_both()").compute_spec == P("data", "model")
    with pytest.raises(bvs.Error, match="the mesh has no axis 'fsdp'"):
      entry('shard_both(storage="fsdp")')


@pytest.mark.parametrize("storage_only", ["axes", 1])
def test_register_refuses_a_storage_only_that_names_no_argument(storage_only):
  with bvs.temporary_ops(), pytest.raises(bvs.Error, match="storage_only is True, False or"):
    bvs.register("shard_first", storage_only=storage_only)(shard_first)


def test_logical_rules_mark_storage_only_axes_through_the_op():
  boxed = nn.LogicallyPartitioned(np.zeros((1024, 2048), np.float32), ("embed", "mlp"))
  rules = [("embed", "data"), ("mlp", "model")]
  tree = {"mlp": {"kernel": boxed}}
  keep = entry("logical_partitioning()", tree, rules=rules)
  assert keep.spec == keep.compute_spec == P("data", "model")
  gather = entry('logical_partitioning(storage_only="data")', tree, rules=rules)
  assert (gather.spec, gather.compute_spec) == (P("data", "model"), P(None, "model"))
  assert gather.why.endswith("; gathered for compute: data")


def test_plan_on_a_jax_make_mesh_and_a_mixed_one():
  explicit = jax.make_mesh((4, 2), ("data", "model"))
  mixed = bvs.make_mesh([("data", 4), ("model", 2)], axis_types=("explicit", "auto"))
  assert mixed.axis_types == (AxisType.Explicit, AxisType.Auto)
  for mesh in (explicit, mixed):
    e = entry('tensor_parallel(axis="model")|fsdp(axis="data")', mesh=mesh)
    assert (e.spec, e.compute_spec) == (P("data", "model"), P(None, "model"))
