"""Inverse p-th roots of stacks of PSD matrices, as Shampoo preconditions with them.

``(S + eps * lambda_max * I)^(-1/p)`` by one of two methods (:data:`ROOT_METHODS`):

- ``"newton"``: the coupled Newton iteration (Guo and Higham 2006, as Anil et al. 2020,
  "Scalable Second Order Optimization for Deep Learning", run it on TPUs): matrix products
  only, batched over the stack, a fixed number of iterations (:data:`NEWTON_ITERATIONS`), so
  it compiles to one loop of matmuls that suits accelerators. ``lambda_max`` comes from a
  power iteration.
- ``"eigh"``: one ``eigh`` per matrix (``lax.map``: a batched ``eigh`` makes jaxlib spread the
  batch over XLA's CPU thread pool and wait, which deadlocks when several simulated devices
  hold the pool's threads). Exact, but slow on accelerators.

:func:`checked` keeps a previous root wherever a new one is not finite or the iteration did
not converge (its residual over :data:`FAILURE_THRESHOLD`). Every root is computed in float32
at least.

Example:
    >>> s = jnp.diag(jnp.array([16.0, 1.0]))[None]
    >>> root, residual = newton_root(s, 2, 0.0)
    >>> root[0].round(3).tolist(), bool(residual[0] < 1e-4)
    ([[0.25, 0.0], [0.0, 1.0]], True)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

ROOT_METHODS = ("newton", "eigh")
# Iterations of the coupled Newton iteration: from a relative ridge of 1e-6 (Shampoo's
# matrix_epsilon), the smallest eigenvalues of the scaled matrix grow about 2.2x an iteration
# (p = 2) to 2.4x (p = 4) until near 1, then converge quadratically: 22 reached a residual of
# 2e-6 on 256-wide statistics, eigenvalues spread over 1e6 or of rank 4 (then 1e-7 from 24);
# the root as close to float64's as float32 eigh's is (the project's roots tests).
NEWTON_ITERATIONS = 24
POWER_ITERATIONS = 16  # lambda_max, for the ridge only: an estimate a few % low is harmless.
FAILURE_THRESHOLD = 0.1  # Max |M - I| of a converged iteration (distributed_shampoo's).


def eigh_root(stats: jax.Array, p: int, matrix_epsilon: float) -> tuple[jax.Array, jax.Array]:
  """(``(S + eps * lambda_max * I)^(-1/p)`` of each matrix of ``stats`` via ``eigh``, a zero
  residual per matrix).

  Example:
      >>> eigh_root(jnp.diag(jnp.array([16.0, 1.0]))[None], 2, 0.0)[0][0].round(3).tolist()
      [[0.25, 0.0], [0.0, 1.0]]
  """
  stats = _float32(stats)
  eigvals, eigvecs = jax.lax.map(jnp.linalg.eigh, stats)
  eigvals = jnp.maximum(eigvals, 0.0)
  max_ev = jnp.max(eigvals, axis=-1, keepdims=True)
  scale = (eigvals + matrix_epsilon * jnp.maximum(max_ev, 1e-16)) ** (-1.0 / p)
  root = jnp.einsum("...ik,...k,...jk->...ij", eigvecs, scale, eigvecs)
  return root, jnp.zeros(stats.shape[:-2], stats.dtype)


def newton_root(stats: jax.Array, p: int, matrix_epsilon: float) -> tuple[jax.Array, jax.Array]:
  """(``(S + eps * lambda_max * I)^(-1/p)`` of each matrix of ``stats`` by the coupled Newton
  iteration, each matrix's residual ``max |M - I|``).

  With ``A = S + ridge`` scaled by ``z = (p + 1) / (2 |A|_F)`` (``|A|_F`` bounds its largest
  eigenvalue, so every eigenvalue of ``M = z A`` lies in ``(0, (p + 1) / 2]``, where the
  iteration converges), ``H = z^(1/p) I``, each iteration takes ``T = ((p + 1) I - M) / p``,
  ``H <- H T`` and ``M <- T^p M``: ``M -> I`` and ``H -> A^(-1/p)``. The iteration is stable at its fixed point: a matrix
  converged early stays there.

  Example:
      >>> root, _ = newton_root(jnp.array([[[4.0, 0.0], [0.0, 9.0]]]), 2, 0.0)
      >>> [round(float(x), 4) for x in jnp.diag(root[0])]
      [0.5, 0.3333]
  """
  stats = _float32(stats)
  eye = jnp.eye(stats.shape[-1], dtype=stats.dtype)
  ridge = matrix_epsilon * jnp.maximum(power_iteration(stats), 1e-16)
  damped = stats + ridge[..., None, None] * eye
  z = (p + 1) / (2 * jnp.maximum(jnp.linalg.norm(damped, axis=(-2, -1)), 1e-30))
  m = z[..., None, None] * damped

  def iteration(_, carry):
    m, h = carry
    t = ((p + 1) * eye - m) / p
    return _matrix_power(t, p) @ m, h @ t

  m, root = jax.lax.fori_loop(
      0, NEWTON_ITERATIONS, iteration, (m, z[..., None, None] ** (1.0 / p) * eye)
  )
  error = jnp.max(jnp.abs(m - eye), axis=(-2, -1))
  return root, error


def checked(root: jax.Array, residual: jax.Array, previous: jax.Array) -> jax.Array:
  """``root``, but ``previous`` for each matrix whose root is not finite or whose
  ``residual`` is over :data:`FAILURE_THRESHOLD` (an iteration that did not converge).

  Example:
      >>> new = jnp.stack([2 * jnp.eye(2), jnp.full((2, 2), jnp.nan)])
      >>> checked(new, jnp.zeros(2), jnp.ones((2, 2, 2)))[:, 0, 0].tolist()
      [2.0, 1.0]
  """
  finite = jnp.all(jnp.isfinite(root), axis=(-2, -1)) & (residual <= FAILURE_THRESHOLD)
  return jnp.where(finite[..., None, None], root, previous.astype(root.dtype))


def power_iteration(stats: jax.Array) -> jax.Array:
  """Each PSD matrix's largest eigenvalue, estimated by :data:`POWER_ITERATIONS` steps of the
  power method from the all-ones vector (never above the true one).

  Example:
      >>> round(float(power_iteration(jnp.diag(jnp.array([3.0, 1.0]))[None])[0]), 4)
      3.0
  """
  start = jnp.ones(stats.shape[:-1], stats.dtype)
  unit = lambda v: v / jnp.maximum(jnp.linalg.norm(v, axis=-1, keepdims=True), 1e-30)
  step = lambda _, v: unit(jnp.einsum("...ij,...j->...i", stats, v))
  v = jax.lax.fori_loop(0, POWER_ITERATIONS, step, unit(start))
  return jnp.einsum("...i,...ij,...j->...", v, stats, v)


def _matrix_power(x: jax.Array, p: int) -> jax.Array:
  """``x^p`` for a static ``p >= 1``, by squaring.

  Example:
      >>> _matrix_power(2 * jnp.eye(2), 5)[0, 0].item()
      32.0
  """
  result = None
  while p:
    if p & 1:
      result = x if result is None else result @ x
    p >>= 1
    if p:
      x = x @ x
  return result


def _float32(stats: jax.Array) -> jax.Array:
  return stats.astype(jnp.promote_types(stats.dtype, jnp.float32))
