"""Symmetric and triangular matrices stored in about half the space: Shampoo's and SOAP's
statistics, Kron's triangular Qs.

A symmetric ``b x b`` matrix (``b`` even, ``n = b / 2``) holds ``b (b + 1) / 2`` numbers. They
are laid out as a ``(b + 1) x n`` array (rows 1 to ``b``: the first ``n`` columns on and below
the diagonal; the slots left above it, row ``r <= j`` of column ``j``: the lower triangle of the
bottom-right ``n x n`` block, transposed), which is then stored row after row as an
``(n + 1) x b`` array, its last ``n`` slots spare (copies of the first number). The stored
array keeps the matrix's last dim (``b``), so the plan splits it over as many devices as the
whole matrix's. :func:`pack` and :func:`unpack` convert on the last two dims of a stack of any
rank, by slices, triangle masks, transposes and reshapes (no gather: an accelerator copies
them at memory speed); unpacking gives an exactly symmetric matrix. An upper-triangular matrix is stored as its transpose's
lower triangle (:func:`pack_upper`, :func:`unpack_upper`). A ``b`` that is odd or below 4
(nothing to gain) is stored whole: :func:`packs`.

Example:
    >>> s = jnp.arange(16.0).reshape(4, 4)
    >>> s = s + s.T
    >>> pack(s).shape, bool((unpack(pack(s)) == s).all())
    ((3, 4), True)
"""

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


def _mirrored(x: jax.Array) -> jax.Array:
  """A stack of square matrices with their lower triangle (diagonal included) mirrored onto
  the upper one.

  Example:
      >>> _mirrored(jnp.array([[1.0, 9.0], [2.0, 3.0]])).tolist()
      [[1.0, 2.0], [2.0, 3.0]]
  """
  return jnp.where(np.tri(x.shape[-1], dtype=bool), x, jnp.swapaxes(x, -1, -2))


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
  n, lead = b // 2, s.shape[:-2]
  left = s[..., :n]  # Rows 1 to b of the (b + 1) x n array, where on or below the diagonal.
  corner = jnp.swapaxes(s[..., n:, n:], -1, -2)  # Row r <= j of column j: s[n + j, n + r].
  r, j = np.indices((n + 1, n))
  zero = jnp.zeros((*lead, 1, n), s.dtype)
  top = jnp.where(
      r > j,
      jnp.concatenate([zero, left[..., :n, :]], axis=-2),
      jnp.concatenate([corner, zero], axis=-2),
  )
  spare = jnp.broadcast_to(s[..., :1, :1], (*lead, 1, n))
  rows = jnp.concatenate([top, left[..., n:, :], spare], axis=-2)  # (b + 2) x n
  return rows.reshape(*lead, n + 1, b)


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
  n, lead = b // 2, packed.shape[:-2]
  a = packed.reshape(*lead, b + 2, n)  # The (b + 1) x n array and its spare row.
  below = a[..., n + 1 : b + 1, :]  # Rows n to b - 1 of the first n columns.
  left = jnp.concatenate([_mirrored(a[..., 1 : n + 1, :]), below], axis=-2)
  corner = _mirrored(jnp.swapaxes(a[..., :n, :], -1, -2))  # The bottom-right block.
  right = jnp.concatenate([jnp.swapaxes(below, -1, -2), corner], axis=-2)
  return jnp.concatenate([left, right], axis=-1)


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
