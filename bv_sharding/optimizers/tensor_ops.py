"""Mode-k tensor products and blocking shared by the second-order optimizers.

Example:
  >>> import jax.numpy as jnp
  >>> x = jnp.ones((2, 3))
  >>> matmul_along(x, 1, 2 * jnp.eye(3)).tolist()
  [[2.0, 2.0, 2.0], [2.0, 2.0, 2.0]]
  >>> gram_along(x, 0).tolist()
  [[3.0, 3.0], [3.0, 3.0]]
"""

import math

import jax
import jax.numpy as jnp


def matmul_along(x: jax.Array, axis: int, m: jax.Array) -> jax.Array:
  """Applies matrix ``m`` to dim ``axis`` of ``x``: ``y[..i..] = m[i, j] x[..j..]``."""
  return jnp.moveaxis(jnp.tensordot(m, x, axes=(1, axis)), 0, axis)


def gram_along(x: jax.Array, axis: int) -> jax.Array:
  """``X X^T`` where X is ``x`` unfolded with ``axis`` as rows: shape (d, d)."""
  others = [a for a in range(x.ndim) if a != axis]
  return jnp.tensordot(x, x, axes=(others, others))


def block_layout(shape, block_size) -> tuple[list[int], list[int]]:
  """(block size, number of blocks) per dim; ``block_size`` is one int or one per dim.

  Example:
    >>> block_layout((6, 3), 4)
    ([4, 3], [2, 1])
    >>> block_layout((6, 3), (3, 1))
    ([3, 1], [2, 3])
  """
  per_dim = [block_size] * len(shape) if isinstance(block_size, int) else block_size
  sizes = [min(d, b) for d, b in zip(shape, per_dim)]
  return sizes, [-(-d // b) for d, b in zip(shape, sizes)]


def blockify(x: jax.Array, block_size) -> jax.Array:
  """Splits every dim into blocks: ``(n_blocks, b_0, ..., b_k)`` (see :func:`block_layout`).

  Dims that are not a multiple of their block size are zero-padded. Blocks
  are ordered row-major over the block grid (dim 0's block index varies
  slowest), so when dim 0 is sharded with shard boundaries on block
  boundaries, each shard's blocks are contiguous along the block axis.

  Example:
    >>> blockify(jnp.zeros((6, 3)), 4).shape  # dim 0 padded to 8
    (2, 4, 3)
    >>> x = jnp.arange(16.0).reshape(4, 4)
    >>> blockify(x, 2)[:, 0, 0].tolist()  # top-left entry of each block
    [0.0, 2.0, 8.0, 10.0]
  """
  sizes, counts = block_layout(x.shape, block_size)
  x = jnp.pad(x, [(0, n * b - d) for d, n, b in zip(x.shape, counts, sizes)])
  x = x.reshape([v for nb in zip(counts, sizes) for v in nb])
  rank = len(sizes)
  x = x.transpose([2 * i for i in range(rank)] + [2 * i + 1 for i in range(rank)])
  return x.reshape((math.prod(counts), *sizes))


def unblockify(blocks: jax.Array, shape: tuple[int, ...], block_size) -> jax.Array:
  """Inverse of :func:`blockify`.

  Example:
    >>> x = jnp.arange(18.0).reshape(6, 3)
    >>> bool((unblockify(blockify(x, 4), (6, 3), 4) == x).all())
    True
  """
  sizes, counts = block_layout(shape, block_size)
  rank = len(shape)
  x = blocks.reshape(counts + sizes)
  x = x.transpose([v for i in range(rank) for v in (i, rank + i)])
  x = x.reshape([n * b for n, b in zip(counts, sizes)])
  return x[tuple(slice(0, d) for d in shape)]
