"""Meshes from big_vision's config.mesh."""

import jax
import pytest
from jax.sharding import AxisType

import bv_sharding as bvs


def test_make_mesh_fills_minus_one_and_uses_auto_axes():
  mesh = bvs.make_mesh([("data", -1), ("model", 2)])
  assert dict(mesh.shape) == {"data": 4, "model": 2}
  assert mesh.axis_types == (AxisType.Auto, AxisType.Auto)
  assert mesh.devices.size == 8


def test_make_mesh_on_a_subset_of_devices():
  mesh = bvs.make_mesh([("data", -1)], devices=jax.devices()[:4])
  assert dict(mesh.shape) == {"data": 4}


def test_abstract_mesh_for_a_pod():
  mesh = bvs.make_abstract_mesh([("data", -1), ("model", 8)], 256)
  assert dict(mesh.shape) == {"data": 32, "model": 8}


@pytest.mark.parametrize(
    "config, fragment",
    [
        ([("data", 3), ("model", 2)], "covers 6 devices but there are 8"),
        ([("data", -1), ("model", -1)], "more than one -1"),
        ([("data", -1), ("model", 3)], "do not divide the 8 devices"),
        ([("data", 0)], "sizes > 0 or -1"),
        ([("data", 8), ("data", 1)], "names an axis twice"),
        ([], "non-empty list"),
        ("data", "non-empty list"),
        ([("data", 8.0)], "sizes > 0 or -1"),
    ],
)
def test_bad_mesh_configs(config, fragment):
  with pytest.raises(bvs.ShardingError, match=fragment):
    bvs.make_mesh(config)
