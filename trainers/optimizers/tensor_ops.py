"""Mode-k tensor products shared by the second-order optimizers.

Example:
    >>> import jax.numpy as jnp
    >>> x = jnp.ones((2, 3))
    >>> matmul_along(x, 1, 2 * jnp.eye(3)).tolist()
    [[2.0, 2.0, 2.0], [2.0, 2.0, 2.0]]
    >>> gram_along(x, 0).tolist()
    [[3.0, 3.0], [3.0, 3.0]]
"""

import jax
import jax.numpy as jnp


def matmul_along(x: jax.Array, axis: int, m: jax.Array) -> jax.Array:
    """Applies matrix ``m`` to dim ``axis`` of ``x``: ``y[..i..] = m[i, j] x[..j..]``."""
    return jnp.moveaxis(jnp.tensordot(m, x, axes=(1, axis)), 0, axis)


def gram_along(x: jax.Array, axis: int) -> jax.Array:
    """``X X^T`` where X is ``x`` unfolded with ``axis`` as rows: shape (d, d)."""
    others = [a for a in range(x.ndim) if a != axis]
    return jnp.tensordot(x, x, axes=(others, others))
