"""bv_sharding/fingerprint.py: a plan's digest is its names, shapes, dtypes, specs and mesh
(sizes and axis types)."""

import jax
import numpy as np

import bv_sharding as bvs
from bv_sharding import fingerprint


def test_fingerprint_is_names_shapes_dtypes_specs_and_mesh():
  tree = {"w": jax.ShapeDtypeStruct((64, 32), "float32")}
  mesh = bvs.make_abstract_mesh([("data", 8)], 8)
  sharded = bvs.plan(tree, 'fsdp(axis="data", min_size_to_shard_mb=0)', mesh)
  whole = bvs.plan(tree, "replicate()", mesh)
  assert fingerprint.digest(sharded) == fingerprint.digest(
      bvs.plan(tree, 'shard_dim(axis="data", dim=0)', mesh)
  )  # The same specs by another strategy: the same plan (the why notes do not count).
  assert fingerprint.digest(sharded) != fingerprint.digest(whole)
  other_mesh = bvs.make_abstract_mesh([("data", 4), ("model", 2)], 8)
  assert fingerprint.describe(bvs.plan(tree, "replicate()", other_mesh))[1:] == (
      fingerprint.describe(whole)[1:]
  )
  explicit = bvs.make_abstract_mesh([("data", 8)], 8, axis_types="explicit")
  typed = fingerprint.describe(bvs.plan(tree, "replicate()", explicit))
  assert typed[1:] == fingerprint.describe(whole)[1:] and typed[0] != fingerprint.describe(whole)[0]
  rows = np.array([[1, 2, 3], [1, 2, 3], [1, 5, 3]])
  assert fingerprint.first_difference(rows, 0) == (2, 1)
  assert fingerprint.first_difference(rows, 2) == (0, 1)
