"""Shampoo's and SOAP's statistics and Kron's triangular Qs stored packed: every number of a
symmetric (or triangular) matrix kept once, in about half the space, split as the whole matrix's
last dim is, and given back exactly. Library imports only."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from bv_sharding.optimizers import symmetric


@pytest.mark.parametrize("b", [4, 6, 8, 256])
def test_packing_keeps_each_number_of_the_lower_triangle_once_and_gives_the_matrix_back(b):
  ids = np.arange(1, b * b + 1, dtype=np.float32).reshape(b, b)
  labelled = np.where(np.tri(b, dtype=bool), ids, ids.T)  # Each pair (i, j) its own number.
  packed = np.asarray(symmetric.pack(jnp.asarray(labelled)))
  assert packed.shape == (b // 2 + 1, b)  # The last dim kept: split as the matrix's is.
  kept = np.sort(packed.ravel()[: b * (b + 1) // 2])  # Then b / 2 spare slots.
  np.testing.assert_array_equal(kept, np.sort(ids[np.tril_indices(b)]))
  x = jax.random.normal(jax.random.key(b), (3, 2, b, b))
  s = x + jnp.swapaxes(x, -1, -2)  # A (3, 2) grid of symmetric blocks.
  np.testing.assert_array_equal(symmetric.unpack(symmetric.pack(s)), s)


def _gather_pack(s, b):
  """The layout as flat indices into a ``b x b`` matrix, read by a gather: a second, independent
  construction of the module docstring's layout."""
  n = b // 2
  r, j = np.indices((b + 1, n))
  below = (r >= 1) & (r - 1 >= j)
  rows = np.where(below, (r - 1) * b + j, (n + j) * b + n + r).ravel()
  index = np.concatenate([rows, np.zeros(n, int)]).reshape(n + 1, b)
  return s.reshape(*s.shape[:-2], b * b)[..., index]


def _gather_unpack(packed, b):
  """Entry ``(i, j)`` of the matrix read from the slot of its lower-triangle twin."""
  n = b // 2
  i, j = np.indices((b, b))
  high, low = np.maximum(i, j), np.minimum(i, j)
  index = np.where(low < n, (high + 1) * n + low, (low - n) * n + high - n)
  return packed.reshape(*packed.shape[:-2], -1)[..., index]


@pytest.mark.parametrize("b, lead", [(4, ()), (6, (3,)), (256, (2, 1, 3))])
def test_packing_moves_the_same_numbers_as_a_gather_of_the_layout(b, lead):
  x = np.asarray(jax.random.normal(jax.random.key(b), (*lead, b, b)))
  s = x + np.swapaxes(x, -1, -2)
  for m in (s, x):  # Only the lower triangle is read: a matrix that is not symmetric too.
    np.testing.assert_array_equal(symmetric.pack(jnp.asarray(m)), _gather_pack(m, b))
  packed = np.asarray(jax.random.normal(jax.random.key(1), (*lead, b // 2 + 1, b)))
  np.testing.assert_array_equal(symmetric.unpack(jnp.asarray(packed)), _gather_unpack(packed, b))
  np.testing.assert_array_equal(jax.jit(symmetric.unpack)(symmetric.pack(s)), s)


def test_a_sharded_step_packs_and_unpacks_the_same_numbers_as_one_device():
  mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  b, stack, split = 64, P("data", None, "model"), P(None, None, ("data", "model"))
  x = np.asarray(jax.random.normal(jax.random.key(0), (8, b, b)))
  packed = np.asarray(jax.random.normal(jax.random.key(1), (8, b // 2 + 1, b)))
  upper = np.swapaxes(_gather_unpack(packed, b), -1, -2) * np.tri(b, dtype=bool).T
  cases = [
      (symmetric.pack, x, _gather_pack(x, b)),
      (symmetric.unpack, packed, _gather_unpack(packed, b)),
      (symmetric.unpack_upper, packed, upper),
  ]
  for fn, arg, expected in cases:
    for given, kept in [(stack, split), (split, stack)]:  # Stored split and a tile's split.
      shard = lambda spec: NamedSharding(mesh, spec)
      out = jax.jit(fn, out_shardings=shard(kept))(jax.device_put(arg, shard(given)))
      np.testing.assert_array_equal(out, expected)


@pytest.mark.parametrize("b", [1, 2, 3, 5])
def test_an_odd_or_tiny_size_is_stored_whole(b):
  s = jnp.eye(b)
  assert not symmetric.packs(b)
  assert symmetric.pack(s) is s and symmetric.unpack(s) is s


@pytest.mark.parametrize("b", [3, 4, 8])
def test_an_upper_triangular_matrix_packs_its_upper_triangle(b):
  q = jnp.triu(jax.random.normal(jax.random.key(b), (2, b, b)))
  packed = symmetric.pack_upper(q)
  assert packed.shape == ((2, b // 2 + 1, b) if symmetric.packs(b) else (2, b, b))
  np.testing.assert_array_equal(symmetric.unpack_upper(packed), q)
