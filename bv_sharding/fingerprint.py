"""A plan's fingerprint, and the check that every process of a job computed the same plan.

Each process of a multi-host job plans on its own. A different config, package
version or strategy on one host would give it other shardings, and the job would
hang in its first collective or compute garbage. :func:`check_same_plan` compares
fingerprints across processes before anything is allocated and raises naming the
first leaf that differs.

The fingerprint covers the mesh (axis names, sizes and types: some specs depend on the
types) and every leaf's name, shape, dtype and spec, in tree order; not the ``why`` notes,
which are for people.

Example:
  >>> import jax
  >>> import bv_sharding as bvs
  >>> tree = {"w": jax.ShapeDtypeStruct((64, 32), "float32")}
  >>> plan = bvs.plan(tree, 'fsdp(axis="data", min_size_to_shard_mb=0)',
  ...                 bvs.make_abstract_mesh([("data", 8)], 8))
  >>> describe(plan)
  ["mesh {'data': 8} axis types {'data': 'auto'}", "w (64, 32) float32 P('data', None)"]
  >>> len(digest(plan))
  64
  >>> check_same_plan(plan)   # one process: nothing to compare
"""

import hashlib
import zlib

import jax
import numpy as np
from jax.experimental import multihost_utils

from bv_sharding.errors import ShardingError
from bv_sharding.planning import Plan

DIGEST_BYTES = 32


def describe(plan: Plan) -> list[str]:
  """One line for the mesh (sizes and axis types), then one per leaf: ``name shape dtype spec``."""
  leaves = [f"{e.name} {e.shape} {np.dtype(e.dtype).name} {e.spec}" for e in plan.entries]
  return [f"mesh {dict(plan.mesh.shape)} axis types {plan.axis_types}", *leaves]


def digest(plan: Plan) -> str:
  """SHA-256 hex digest of :func:`describe`: stable across processes, runs and hosts."""
  return hashlib.sha256("\n".join(describe(plan)).encode()).hexdigest()


def check_same_plan(plan: Plan) -> None:
  """Raises ``ShardingError`` unless every jax process computed the same plan.

  Call it on every process after planning and before allocating. Two small
  ``process_allgather`` rounds: the digests (the only round when they agree),
  then one CRC per line to find the first line that differs.
  """
  lines = describe(plan)
  rows = line_checksums(lines)
  if rows is not None:
    raise ShardingError(_difference(lines, rows, jax.process_index()))


def line_checksums(lines: list[str]) -> np.ndarray | None:
  """None when every jax process has the same ``lines``; else every process's CRC of each line.

  Rows are processes, columns lines (0 past a process's last line). Call it on every
  process: one ``process_allgather`` of a digest when the lines agree, a second of the CRCs.

  Example: ``line_checksums(["lr 0.001"])`` is None on one process.
  """
  if jax.process_count() == 1:
    return None
  mine = np.frombuffer(hashlib.sha256("\n".join(lines).encode()).digest(), np.uint8)
  heads = multihost_utils.process_allgather(np.append(mine, len(lines)).astype(np.int32))
  if (heads == heads[0]).all():
    return None
  crcs = np.zeros(int(heads[:, DIGEST_BYTES].max()), np.int32)
  crcs[: len(lines)] = [
      np.int32(np.uint32(zlib.crc32(line.encode())).view(np.int32)) for line in lines
  ]
  return multihost_utils.process_allgather(crcs)


def first_difference(rows: np.ndarray, me: int) -> tuple[int, int]:
  """``(other process, line index)``: the first process whose row differs from row ``me``
  (from process 0's, for process 0 the first other that differs) and where."""
  other = next(p for p in range(len(rows)) if (rows[p] != rows[me]).any())
  return other, int(np.argmax(rows[other] != rows[me]))


def _difference(lines: list[str], rows: np.ndarray, me: int) -> str:
  other, index = first_difference(rows, me)
  here = lines[index] if index < len(lines) else f"no line {index} (this plan has {len(lines)})"
  what = "the mesh" if index == 0 else f"leaf #{index - 1}"
  return (
      f"process {me} and process {other} computed different sharding plans, first at "
      f"{what}: here {here!r}. Every host must run the same config, strategy, mesh and "
      "package versions; compare plan.report() on both hosts."
  )
