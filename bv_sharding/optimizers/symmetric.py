"""Symmetric and triangular matrices stored in about half the space: Shampoo's and SOAP's
statistics, Kron's triangular Qs.

A symmetric ``b x b`` matrix (``b`` even, ``n = b / 2``) holds ``b (b + 1) / 2`` numbers. They
are laid out as a ``(b + 1) x n`` array (rows 1 to ``b``: the first ``n`` columns on and below
the diagonal; the slots left above it, row ``r <= j`` of column ``j``: the lower triangle of the
bottom-right ``n x n`` block, transposed), which is then stored row after row as an
``(n + 1) x b`` array, its last ``n`` slots spare (copies of the first number). The stored
array keeps the matrix's last dim (``b``), so the plan splits it over as many devices as the
whole matrix's. :func:`pack` and :func:`unpack` convert on the last two dims of a stack of any
rank, by slices, triangle masks, transposes and concatenations (no gather: an accelerator
copies them at memory speed). Rows are paired by a reshape of the second-to-last dim only, and
each input and output passes through a flat view (:func:`_regathered`), so that a sharded step
reads whole matrices and neither the stored split of the last dim nor the caller's spreads
through the copies (where it did, a sharded step replicated them, and once gave wrong Qs).
Unpacking gives an exactly symmetric matrix. An upper-triangular matrix is stored as its
transpose's lower triangle (:func:`pack_upper`, :func:`unpack_upper`). A ``b`` that is odd or
below 4 (nothing to gain) is stored whole: :func:`packs`.

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


def _lower_triangle(x: jax.Array) -> jax.Array:
  """A stack of square matrices with zeros above the diagonal.

  Example:
      >>> _lower_triangle(jnp.array([[1.0, 9.0], [2.0, 3.0]])).tolist()
      [[1.0, 0.0], [2.0, 3.0]]
  """
  return jnp.where(np.tri(x.shape[-1], dtype=bool), x, jnp.zeros((), x.dtype))


def _regathered(x: jax.Array) -> jax.Array:
  """``x`` unchanged, through a flat view of its last two dims behind an optimization barrier:
  a split of the last dim cannot follow it, so a sharded step gathers whole matrices here, as
  it would for a gather, instead of spreading the split through the copies.

  Example:
      >>> _regathered(jnp.eye(2)).tolist()
      [[1.0, 0.0], [0.0, 1.0]]
  """
  flat = jax.lax.optimization_barrier(x.reshape(*x.shape[:-2], -1))
  return flat.reshape(x.shape)


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
  s = _regathered(s)
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
  pairs = rows.reshape(*lead, n + 1, 2, n)  # Stored row p: rows 2p and 2p + 1 side by side.
  return _regathered(jnp.concatenate([pairs[..., 0, :], pairs[..., 1, :]], axis=-1))


def _unpacked_lower(packed: jax.Array) -> jax.Array:
  """The ``b x b`` matrices whose lower triangles (diagonal included) are those of
  :func:`pack`'s ``(..., b / 2 + 1, b)`` stack; above the diagonal: any numbers."""
  n, lead = packed.shape[-1] // 2, packed.shape[:-2]
  packed = _regathered(packed)
  halves = jnp.stack([packed[..., :n], packed[..., n:]], axis=-2)
  a = halves.reshape(*lead, 2 * n + 2, n)  # The (b + 1) x n array and its spare row.
  corner = jnp.swapaxes(a[..., :n, :], -1, -2)  # The bottom-right block's lower triangle.
  right = jnp.concatenate([jnp.zeros((*lead, n, n), packed.dtype), corner], axis=-2)
  return jnp.concatenate([a[..., 1 : 2 * n + 1, :], right], axis=-1)


def _packed(packed: jax.Array) -> bool:
  """Whether ``packed`` is a stack of :func:`pack`'s arrays (else of whole matrices)."""
  rows, b = packed.shape[-2:]
  return packs(b) and rows == b // 2 + 1


def unpack(packed: jax.Array) -> jax.Array:
  """The symmetric ``b x b`` matrices of :func:`pack`'s ``(..., b / 2 + 1, b)`` stack (a
  stack of whole matrices unchanged).

  Example:
      >>> bool((unpack(pack(2 * jnp.eye(4))) == 2 * jnp.eye(4)).all())
      True
  """
  if not _packed(packed):
    return packed
  lower = _unpacked_lower(packed)
  full = jnp.where(np.tri(packed.shape[-1], dtype=bool), lower, jnp.swapaxes(lower, -1, -2))
  return _regathered(full)


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
  if not _packed(packed):
    return packed
  return _regathered(jnp.swapaxes(_lower_triangle(_unpacked_lower(packed)), -1, -2))
