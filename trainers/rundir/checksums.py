"""Checksums of a train state's arrays: saved with each checkpoint, checked when it is read.

A leaf's checksum is the sum of its elements' bit patterns, each times an odd weight that
depends on the element's position (``2 i + 1``), wrapping at 2**32. It is one jitted
reduction on the devices that hold the array, in any sharding (a sum of integers does not
depend on the order it is taken in), so a save reads and writes nothing more; a restore
computes it again on the arrays it read, in the dtype they were saved in. Any one changed
element changes it (an odd weight is invertible modulo 2**32); several changed elements
leave it unchanged with a chance of about 2**-32.

Example:
  >>> import jax.numpy as jnp
  >>> tree = {"w": jnp.arange(6, dtype=jnp.float32).reshape(2, 3), "n": jnp.int32(7)}
  >>> sums = of(tree)
  >>> sums == of({"w": tree["w"].at[1, 2].set(5.5), "n": tree["n"]}), sorted(sums)
  (False, ['n', 'w'])
  >>> mismatch(sums, of(tree)) is None, mismatch(sums, {**sums, "w": 1})
  (True, 'w')
"""

import jax
import jax.numpy as jnp
import numpy as np


def of(tree) -> dict[str, int]:
  """``{leaf name: checksum}`` of ``tree``'s arrays (names as ``jax.tree_util.keystr`` with
  "/"); waits for the sums, not for anything else."""
  flat, _ = jax.tree_util.tree_flatten_with_path(tree)
  named = [(name(path), x) for path, x in flat if isinstance(x, jax.Array)]
  sums = jax.device_get(_sums([x for _, x in named]))
  return {leaf: int(s) for (leaf, _), s in zip(named, sums)}


def mismatch(saved: dict[str, int], read: dict[str, int]) -> str | None:
  """The first leaf of ``read`` whose checksum is not the ``saved`` one (None: all agree; a
  leaf ``saved`` lacks is not checked)."""
  return next((leaf for leaf, s in read.items() if leaf in saved and saved[leaf] != s), None)


def name(path) -> str:
  """A leaf's name: its key path joined by "/"."""
  return jax.tree_util.keystr(path, simple=True, separator="/")


@jax.jit
def _sums(arrays: list) -> list:
  """Each array's checksum: one program for a whole tree."""
  return [_sum(x) for x in arrays]


def _sum(x: jax.Array) -> jax.Array:
  """The checksum of one array (module docstring), a uint32 scalar."""
  bits = _words(x).reshape(-1)
  weights = jnp.arange(bits.size, dtype=jnp.uint32) * jnp.uint32(2) + jnp.uint32(1)
  return jnp.sum(bits * weights, dtype=jnp.uint32)


def _words(x: jax.Array) -> jax.Array:
  """``x``'s bit patterns as uint32 (64-bit elements as two words each)."""
  if x.dtype == jnp.bool_:
    return x.astype(jnp.uint32)
  width = np.dtype(x.dtype).itemsize
  unsigned = _UNSIGNED[min(width, 4)]
  if width == 8:
    return jax.lax.bitcast_convert_type(x, jnp.uint32)
  return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)


_UNSIGNED = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}
