"""Symmetric matrices stored in about half the space: Shampoo's and SOAP's statistics.

A symmetric ``b x b`` matrix (``b`` even, ``n = b / 2``) holds ``b (b + 1) / 2`` numbers. They
are laid out as a ``(b + 1) x n`` array (rows 1 to ``b``: the first ``n`` columns on and below
the diagonal; the slots left above it, row ``r <= j`` of column ``j``: the lower triangle of the
bottom-right ``n x n`` block, transposed), which is then stored row after row as an
``(n + 1) x b`` array, its last ``n`` slots zero. The stored array keeps the matrix's last dim
(``b``), so the plan splits it over as many devices as the whole matrix's. :func:`pack` and
:func:`unpack` convert, one gather each, on the last two dims of a stack of any rank; unpacking
gives an exactly symmetric matrix. A ``b`` that is odd or below 4 (nothing to gain) is stored
whole: :func:`packs`.

Example:
    >>> s = jnp.arange(16.0).reshape(4, 4)
    >>> s = s + s.T
    >>> pack(s).shape, bool((unpack(pack(s)) == s).all())
    ((3, 4), True)
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np


def packs(b: int) -> bool:
  """Whether a ``b x b`` statistic is stored packed, as ``(b / 2 + 1, b)``.

  Example:
      >>> packs(256), packs(3), packs(2)
      (True, False, False)
  """
  return b % 2 == 0 and b >= 4


@functools.cache
def _pack_index(b: int) -> np.ndarray:
  """For each slot of the packed ``(b / 2 + 1, b)`` array, the flat index of its number in a
  ``b x b`` matrix (module docstring); ``b * b`` (out of range: zero) for the spare slots."""
  n = b // 2
  r, j = np.indices((b + 1, n))
  below = (r >= 1) & (r - 1 >= j)
  rows = np.where(below, (r - 1) * b + j, (n + j) * b + n + r).ravel()
  return np.concatenate([rows, np.full(n, b * b)]).reshape(n + 1, b)


@functools.cache
def _unpack_index(b: int) -> np.ndarray:
  """For each entry of a ``b x b`` matrix, the flat index of its slot in the packed array:
  entry ``(i, j)`` is read where its lower-triangle twin ``(max, min)`` is kept."""
  n = b // 2
  i, j = np.indices((b, b))
  high, low = np.maximum(i, j), np.minimum(i, j)
  return np.where(low < n, (high + 1) * n + low, (low - n) * n + high - n)


def pack(s: jax.Array) -> jax.Array:
  """A stack of symmetric ``b x b`` matrices as ``(..., b / 2 + 1, b)`` where :func:`packs`,
  else unchanged. Reads the lower triangle.

  Example:
      >>> pack(2 * jnp.eye(4)).tolist()
      [[2.0, 0.0, 2.0, 2.0], [0.0, 2.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]
  """
  b = s.shape[-1]
  if not packs(b):
    return s
  flat = s.reshape(*s.shape[:-2], b * b)
  return jnp.take(flat, _pack_index(b), axis=-1, mode="fill", fill_value=0)


def unpack(packed: jax.Array) -> jax.Array:
  """The symmetric ``b x b`` matrices of :func:`pack`'s ``(..., b / 2 + 1, b)`` stack (a
  stack of whole matrices unchanged).

  Example:
      >>> bool((unpack(pack(2 * jnp.eye(4))) == 2 * jnp.eye(4)).all())
      True
  """
  rows, b = packed.shape[-2:]
  if not (packs(b) and rows == b // 2 + 1):
    return packed
  return packed.reshape(*packed.shape[:-2], rows * b)[..., _unpack_index(b)]
