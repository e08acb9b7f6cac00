"""Shampoo's inverse p-th roots: the coupled Newton iteration against float64 ``eigh`` on random
SPD matrices (well and ill conditioned, of low rank), and a failed root falling back. Library
imports only."""

import jax.numpy as jnp
import numpy as np
import pytest

from bv_sharding.optimizers import roots


def _truth(a: np.ndarray, p: int, eps: float) -> np.ndarray:
  w, v = np.linalg.eigh(a.astype(np.float64))
  w = np.maximum(w, 0.0)
  return (v * (w + eps * w.max()) ** (-1.0 / p)) @ v.T


def _spd(kind: str, n: int, rng) -> np.ndarray:
  q, _ = np.linalg.qr(rng.standard_normal((n, n)))
  spectra = {
      "well": rng.uniform(0.5, 2.0, n),
      "spread": np.logspace(-6, 0, n),  # condition 1e6
      "rank4": np.r_[rng.uniform(1.0, 2.0, 4), np.zeros(n - 4)],  # the ridge alone elsewhere
  }
  return (q * spectra[kind]) @ q.T


@pytest.mark.parametrize("kind", ["well", "spread", "rank4"])
@pytest.mark.parametrize("p", [2, 4])
def test_newton_root_is_as_close_to_float64_as_float32_eigh(kind, p):
  rng = np.random.default_rng(p)
  a = np.stack([_spd(kind, 64, rng), 1e3 * _spd(kind, 64, rng)])  # scale-free
  truth = np.stack([_truth(x, p, 1e-6) for x in a])
  error = lambda root: [
      np.linalg.norm(np.asarray(r, np.float64) - t) / np.linalg.norm(t) for r, t in zip(root, truth)
  ]
  newton, residual = roots.newton_root(jnp.asarray(a, jnp.float32), p, 1e-6)
  eigh, _ = roots.eigh_root(jnp.asarray(a, jnp.float32), p, 1e-6)
  assert np.all(np.asarray(residual) < 1e-5)  # converged in its fixed iteration count
  assert max(error(newton)) < max(3 * max(error(eigh)), 1e-3)


def test_a_root_that_fails_keeps_the_previous_one():
  """A non-finite matrix gives a non-finite root: the previous one is kept, the good one not."""
  stats = jnp.stack([jnp.diag(jnp.array([4.0, 1.0])), jnp.full((2, 2), jnp.nan)])
  root = roots.checked(*roots.newton_root(stats, 2, 0.0), jnp.stack([jnp.eye(2)] * 2))
  np.testing.assert_allclose(root[0], np.diag([0.5, 1.0]), rtol=1e-5)
  np.testing.assert_array_equal(root[1], np.eye(2))
  _, residual = roots.newton_root(stats, 2, 0.0)
  assert not residual[1] <= roots.FAILURE_THRESHOLD
