"""Symmetric and triangular matrices stored in about half the space: Shampoo's and SOAP's
statistics, Kron's triangular Qs.

A symmetric ``b x b`` matrix (``b`` even, ``n = b / 2``) holds ``b (b + 1) / 2`` numbers. They
are laid out as a ``(b + 1) x n`` array (rows 1 to ``b``: the first ``n`` columns on and below
the diagonal; the slots left above it, row ``r <= j`` of column ``j``: the lower triangle of the
bottom-right ``n x n`` block, transposed), which is then stored row after row as an
``(n + 1) x b`` array, its last ``n`` slots spare (copies of the first number). The stored array keeps the matrix's last dim
(``b``), so the plan splits it over as many devices as the whole matrix's. :func:`pack` and
:func:`unpack` convert, one gather each, on the last two dims of a stack of any rank; unpacking
gives an exactly symmetric matrix. An upper-triangular matrix is stored as its transpose's
lower triangle (:func:`pack_upper`, :func:`unpack_upper`). A ``b`` that is odd or below 4
(nothing to gain) is stored whole: :func:`packs`.

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
  ``b x b`` matrix (module docstring); 0 for the spare slots. Unsigned, so that the gather
  needs no negative-index fix-up."""
  n = b // 2
  r, j = np.indices((b + 1, n))
  below = (r >= 1) & (r - 1 >= j)
  rows = np.where(below, (r - 1) * b + j, (n + j) * b + n + r).ravel()
  return np.concatenate([rows, np.zeros(n, int)]).reshape(n + 1, b).astype(np.uint32)


@functools.cache
def _unpack_index(b: int) -> np.ndarray:
  """For each entry of a ``b x b`` matrix, the flat index of its slot in the packed array:
  entry ``(i, j)`` is read where its lower-triangle twin ``(max, min)`` is kept."""
  n = b // 2
  i, j = np.indices((b, b))
  high, low = np.maximum(i, j), np.minimum(i, j)
  index = np.where(low < n, (high + 1) * n + low, (low - n) * n + high - n)
  return index.astype(np.uint32)


def pack(s: jax.Array) -> jax.Array:
  """A stack of symmetric ``b x b`` matrices as ``(..., b / 2 + 1, b)`` where :func:`packs`,
  else unchanged. Reads the lower triangle.

  Example:
      >>> pack(2 * jnp.eye(4)).tolist()
      [[2.0, 0.0, 2.0, 2.0], [0.0, 2.0, 0.0, 0.0], [0.0, 0.0, 2.0, 2.0]]
  """
  b = s.shape[-1]
  if not packs(b):
    return s
  flat = s.reshape(*s.shape[:-2], b * b)
  return flat.at[..., _pack_index(b)].get(mode="promise_in_bounds")


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
  flat = packed.reshape(*packed.shape[:-2], rows * b)
  return flat.at[..., _unpack_index(b)].get(mode="promise_in_bounds")


def pack_upper(q: jax.Array) -> jax.Array:
  """A stack of upper-triangular ``b x b`` matrices (Kron's Qs) in :func:`pack`'s layout: their
  transposes' lower triangles, the same numbers; unchanged where ``b`` is not :func:`packs`.

  Example:
      >>> q = jnp.triu(jnp.ones((4, 4)))
      >>> pack_upper(q).shape, bool((unpack_upper(pack_upper(q)) == q).all())
      ((3, 4), True)
  """
  return pack(jnp.swapaxes(q, -1, -2)) if packs(q.shape[-1]) else q


def unpack_upper(packed: jax.Array) -> jax.Array:
  """The upper-triangular matrices of :func:`pack_upper` (a stack of whole ones unchanged)."""
  full = unpack(packed)
  return packed if full is packed else jnp.triu(full)
