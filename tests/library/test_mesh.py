"""Meshes from big_vision's config.mesh, and hybrid ICI x DCN meshes over stand-in TPU slices."""

import dataclasses
import re

import jax
import numpy as np
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


@dataclasses.dataclass(frozen=True)
class StandInTpu:
  """What jax's mesh_utils reads of a TPU device: id, slice, chip coordinates, core."""

  id: int
  slice_index: int
  coords: tuple[int, int, int]
  core_on_chip: int = 0
  process_index: int = 0
  platform: str = "tpu"
  device_kind: str = "TPU v4"


def two_slices_of_eight():
  return [StandInTpu(8 * s + i, s, (i % 2, i // 2 % 2, i // 4)) for s in range(2) for i in range(8)]


def test_hybrid_mesh_puts_slices_outermost_on_the_dcn_axis():
  devices = two_slices_of_eight()
  mesh = bvs.make_mesh([("data", -1), ("model", 4)], devices, dcn_mesh=[("data", 2)])
  assert dict(mesh.shape) == {"data": 4, "model": 4}
  assert mesh.axis_types == (AxisType.Auto, AxisType.Auto)
  slices = np.vectorize(lambda d: d.slice_index)(mesh.devices)
  assert (slices[:2] == 0).all() and (slices[2:] == 1).all()  # The model axis stays in a slice.
  assert sorted(d.id for d in mesh.devices.flat) == list(range(16))


def test_hybrid_mesh_matches_its_abstract_shape():
  config_mesh, dcn = [("data", -1), ("model", 2)], [("model", 2)]
  mesh = bvs.make_mesh(config_mesh, two_slices_of_eight(), dcn_mesh=dcn)
  abstract = bvs.make_abstract_mesh(config_mesh, 16, dcn_mesh=dcn)
  assert dict(mesh.shape) == dict(abstract.shape) == {"data": 4, "model": 4}
  pod = bvs.make_abstract_mesh([("data", -1), ("model", 4)], 512, dcn_mesh=[("data", 2)])
  assert dict(pod.shape) == {"data": 128, "model": 4}


@pytest.mark.parametrize(
    "devices, config_mesh, dcn, fragment",
    [
        (None, [("data", -1)], [("data", 2)], "cpu:0 (cpu) has no slice_index"),
        ("tpu", [("data", -1)], [("data", 4)], "covers 4 devices but there are 2"),
        ("tpu", [("data", -1)], [("fsdp", 2)], "names axis 'fsdp'"),
        ("tpu", [("data", 3), ("model", -1)], [("data", 2)], "do not divide the 8 devices"),
    ],
)
def test_hybrid_mesh_errors(devices, config_mesh, dcn, fragment):
  devices = two_slices_of_eight() if devices == "tpu" else devices
  with pytest.raises(bvs.ShardingError, match=re.escape(fragment)):
    bvs.make_mesh(config_mesh, devices, dcn_mesh=dcn)


def test_abstract_hybrid_mesh_needs_the_slice_count_for_minus_one():
  with pytest.raises(bvs.ShardingError, match="has a -1"):
    bvs.make_abstract_mesh([("data", -1)], 64, dcn_mesh=[("data", -1)])
  mesh = bvs.make_abstract_mesh([("data", -1)], 64, dcn_mesh=[("data", -1)], num_slices=4)
  assert dict(mesh.shape) == {"data": 64}


@pytest.mark.parametrize("count", [0, -1, -256, True, 2.5, "8", None])
def test_device_counts(count):
  with pytest.raises(bvs.ShardingError, match=r"num_devices=.*devices >= 1"):
    bvs.make_abstract_mesh([("data", -1)], count)


def test_make_mesh_on_no_devices():
  with pytest.raises(bvs.ShardingError, match=r"num_devices=0"):
    bvs.make_mesh([("data", -1)], devices=[])


@pytest.mark.parametrize(
    "choice, types",
    [
        ("explicit", (AxisType.Explicit, AxisType.Explicit)),
        (AxisType.Explicit, (AxisType.Explicit, AxisType.Explicit)),
        ("auto", (AxisType.Auto, AxisType.Auto)),
        (("explicit", AxisType.Auto), (AxisType.Explicit, AxisType.Auto)),
    ],
)
def test_meshes_take_axis_types(choice, types):
  assert bvs.make_mesh([("data", -1), ("model", 2)], axis_types=choice).axis_types == types
  assert (
      bvs.make_abstract_mesh([("data", -1), ("model", 2)], 64, axis_types=choice).axis_types
      == types
  )


@pytest.mark.parametrize(
    "choice, fragment",
    [
        ("Explicit", "did you mean 'explicit'"),
        ("manual", 'use "auto" or "explicit"'),
        (AxisType.Manual, "AxisType.Auto / .Explicit"),
        (("auto",), "one per axis"),
        (None, "one for all axes"),
    ],
)
def test_bad_axis_types_are_refused(choice, fragment):
  for build in (
      bvs.make_mesh,
      lambda m, axis_types: bvs.make_abstract_mesh(m, 8, axis_types=axis_types),
  ):
    with pytest.raises(bvs.Error, match=re.escape(fragment)):
      build([("data", -1), ("model", 2)], axis_types=choice)
