"""Shampoo's and SOAP's statistics and Kron's triangular Qs stored packed: every number of a
symmetric (or triangular) matrix kept once, in about half the space, split as the whole matrix's
last dim is, and given back exactly. Library imports only."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

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
