"""PSGD Kron: a Kronecker-factored preconditioner fitted online to whiten grads.

Re-implementation of the PSGD "Kron" optimizer (Xi-Lin Li,
https://github.com/lixilinx/psgd_torch; JAX port psgd-jax 0.2.9) for current
JAX/optax. The optimizer state uses psgd-jax's layout so checkpoints and
sharding rules written for it carry over::

    {"count": int32[],                  # number of updates applied
     "mu": params-like tree or None,    # momentum (None when b1 == 0)
     "Qs_preconditioners": params-like tree whose leaves are LISTS of Q,
                           # one Q per param dim: (d, d) upper triangular or
                           # (d,) diagonal; scanned params get (L, d, d)/(L, d);
                           # blocked params a Stacks of (*grid, b/2 + 1, b)
                           # (triangular, packed; b odd or 2: (*grid, b, b))
                           # or (*grid, b) (diagonal);
                           # scalars get one () diagonal Q
     "update_counter": int32[]}         # steps since the last Q update

and, with ``resident_padding``, ``"pools"``: the Qs of the pools kept where they run (a
:class:`~bv_sharding.optimizers.pools.Resident` each, their members' own ``Stacks`` empty).

A param of at least 2 (per-layer) dims keeps its Qs in a
:class:`~bv_sharding.optimizers.placement.Stacks` (a tuple, named like a list): blocked, each
Q with the param's block grid first, each triangular Q stored packed, its upper triangle's
numbers once (:func:`~bv_sharding.optimizers.symmetric.pack_upper`: half the memory, and half
the bytes a pool moves); unblocked (``block_size`` None), one tile of the whole param, in
psgd-jax's shapes. The state is the same on any mesh.

With ``block_size`` set (as distributed_kron's ``partition_grads_into_blocks``),
every param whose (per-layer) dims number at least 2 is split into blocks of at
most ``block_size`` per dim, and each block gets its own Kron preconditioner:
``Qs = [(g_0, g_1, b_0, b_0), (g_0, g_1, b_1, b_1)]`` for a 2-D param with a ``g_0 x g_1``
grid of blocks (a scanned param's layers first), vmapped like scanned layers. ``mu`` stays
param-shaped. A scanned param is blocked layer by layer (its layer axis is never cut).
With ``layout`` (the params' specs and mesh, see :mod:`bv_sharding.optimizers.layout`) the
tiles inside each device's shard are stored on that device and fitted and applied in
``shard_map`` where they live (no collective but scalars); tiles that span shards are dealt
to owners among their
holders, or pooled with every param's tiles of their shape and dealt over the mesh
(all params' blocks go through one :func:`~bv_sharding.optimizers.blocked.run_blocked`).
Without it the param is one shard (blocks row-major over the block grid). Unblocked
(``block_size`` None), each such param is one tile of its own shape: with a layout it is
fitted whole by one device, like any tile that spans shards, where psgd-jax leaves the fit
of the sharded param to XLA's partitioner (the same math, and its trajectory).
Padding (dims not a multiple of ``block_size``) is zero in grads and probes, so
Q's padded rows and columns stay decoupled from the real ones: a padded block
acts like a smaller one. Every stacked preconditioner (a tile's or a scanned param's)
solves ``v Q^{-1}`` with :func:`triangular_inverse` (matmuls) instead of a
batched LAPACK ``triangular_solve``, which deadlocks XLA:CPU with several
devices; only a param with a single preconditioner (fewer than 2 dims) calls LAPACK, one
matrix at a time.

As in psgd-jax, a stacked preconditioner's fit runs under ``lax.cond``: only on the
steps that update Q (``preconditioner_update_probability``), and a pool draws the probe
and moves the fit's target in, and its Qs back, only then. A single preconditioner's fit (a LAPACK
triangular solve) is computed on every step and kept with ``jnp.where`` instead: batched
LAPACK calls inside ``lax.cond`` can deadlock XLA:CPU with several devices. Randomness
(probing vectors, balancing coin) comes from ``fold_in(PRNGKey(5318008),
count)`` with the same splits as psgd-jax, so runs are deterministic and match
the reference. A param cut into mesh-independent tiles (``blocking="tiles"``), or unblocked and
not scanned, draws its probe tile by tile, each tile from its own key
(:class:`~bv_sharding.optimizers.draws.TileNormal`): a pool draws its tiles where it fits
them instead of moving a param-shaped probe, and a param of one tile draws psgd-jax's.

Each tile's Qs are born zero (``preconditioner_init_scale`` None, the default) and set on its
first update to ``scale * I`` from the momentum they precondition (:func:`first_scale`), so that
the first update's RMS is Adam's where the momentum is nonzero, whatever the gradients' scale and
tails, where psgd-jax 0.2.9's ``Q = I`` (``preconditioner_init_scale=1.0``) makes it the
gradients' own. Psgd_torch's ``KronWhiten`` (Xi-Lin Li, 2025) also sets Q from the first
gradient, by its fourth moment. A tile's own momentum, so the
same on any mesh, and on a state born mid-run (whatever its carried ``count``).

Storage and compute dtypes: ``mu_dtype`` and ``precond_dtype`` (default: the params')
store the momentum and the Qs; the fit casts its result to the Qs' dtype. Under a config-built
training loop both follow ``config.state_dtype`` unless set in ``config.optax``, and the whole
update, factor fits included, runs in float32 (:mod:`bv_sharding.optimizers.state_dtype`).

Example:
    >>> import jax.numpy as jnp
    >>> opt = kron(1e-3, preconditioner_update_probability=1.0)
    >>> params = {"w": jnp.ones((4, 3)), "b": jnp.zeros(3)}
    >>> state = opt.init(params)
    >>> [q.shape for q in state[0]["Qs_preconditioners"]["w"]]  # one tile: 4 x 4 packed, 3 x 3
    [(1, 1, 3, 4), (1, 1, 3, 3)]
    >>> updates, state = opt.update(params, state, params)
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from optax import tree_utils as otu

from bv_sharding.errors import OptimizerError
from bv_sharding.optimizers import blocked, gating, holding, opaque, symmetric
from bv_sharding.optimizers.draws import TileNormal
from bv_sharding.optimizers.layout import ParamLayout, stacked_leaves
from bv_sharding.optimizers.placement import Stacks, Tiling
from bv_sharding.optimizers.pools import Resident
from bv_sharding.optimizers.tensor_ops import gram_along
from bv_sharding.optimizers.tiles import ShardBlocks

_PRNG_SEED = 5318008  # psgd-jax's seed, kept so trajectories match it.
_BALANCE_PROBABILITY = 0.01
_MEMORY_SAVE_MODES = (None, "one_diag", "all_diag")
_BASE_BLOCK = 64  # triangular_inverse's first blocks, inverted in one loop.

Probability = float | Callable[[jax.Array], jax.Array]


def precond_update_prob_schedule(
    max_prob: float = 1.0,
    min_prob: float = 0.03,
    decay: float = 0.001,
    flat_start: int = 500,
) -> Callable[[jax.Array], jax.Array]:
  """Probability of updating Q at step n: flat, then exponential anneal.

  Example:
      >>> sched = precond_update_prob_schedule(flat_start=10)
      >>> float(sched(5)), round(float(sched(4010)), 2)
      (1.0, 0.03)
  """

  def schedule(n):
    prob = max_prob * jnp.exp(-decay * (n - flat_start))
    return jnp.clip(prob, min_prob, max_prob)

  return schedule


def triangular_dims(
    shape: tuple[int, ...],
    max_size_triangular: int,
    min_ndim_triangular: int,
    memory_save_mode: str | None,
) -> list[bool]:
  """Per dim: True if its Q is triangular, False if diagonal.

  Example:
      >>> triangular_dims((16, 8), 8192, 2, "one_diag")
      [False, True]
  """
  if memory_save_mode not in _MEMORY_SAVE_MODES:
    raise OptimizerError(
        f"memory_save_mode={memory_save_mode!r}; expected one of " f"{_MEMORY_SAVE_MODES}"
    )
  forced_diag = [memory_save_mode == "all_diag"] * len(shape)
  if memory_save_mode == "one_diag" and shape:
    largest = max(range(len(shape)), key=lambda i: (shape[i], i))
    forced_diag[largest] = True
  return [
      not diag and 1 < size <= max_size_triangular and len(shape) >= min_ndim_triangular
      for size, diag in zip(shape, forced_diag)
  ]


def init_qs(shape, triangular, scale, dtype) -> list[jax.Array]:
  """Initial Q factors, whose Kronecker product is ``scale * I``.

  Example:
      >>> [q.shape for q in init_qs((3, 2), [True, False], 1.0, jnp.float32)]
      [(3, 3), (2,)]
  """
  if not shape:
    return [jnp.full((), scale, dtype)]
  scale = scale ** (1 / len(shape))
  return [
      scale * (jnp.eye(d, dtype=dtype) if tri else jnp.ones(d, dtype))
      for d, tri in zip(shape, triangular)
  ]


def first_scale(x: jax.Array) -> jax.Array:
  """The scale of a born Q (:func:`init_qs`) that preconditions ``x``: ``m^(-1/4)``, ``m`` the
  mean of ``x^2`` over its nonzero entries, so that ``P x = scale^2 x`` has RMS 1 there, as
  Adam's first update ``sign(x)`` has (and zero where ``x`` is, as Adam's: a sparse embedding
  gradient's tile gets Adam's RMS too), rounded to a power of 2 ** (1/4) (within 9%: the order
  in which a mesh's program sums a tile then does not change it); 1 where ``x`` is zero. A
  tile's zero padding leaves it unchanged. Psgd_torch's ``KronWhiten`` (preconditioner_init_scale
  None) scales by the mean of ``x^4`` to the power -1/8 instead, which a heavy-tailed gradient
  (a language model's) makes 3-7 times smaller than Adam's first update.

  Example:
      >>> [float(first_scale(x)) for x in (jnp.full((2, 3), 16.0), jnp.zeros(3))]
      [0.25, 1.0]
      >>> float(first_scale(jnp.array([0.0, 0.0, 4.0, -4.0])))  # zeros do not count
      0.5
  """
  x = jnp.abs(x.astype(jnp.float32))
  peak = jnp.max(x)
  u = x / jnp.where(peak > 0, peak, 1.0)  # In [0, 1]: no overflow or underflow of its squares.
  mean = jnp.sum(u * u) / jnp.maximum(jnp.sum(u > 0), 1)
  # Rounded: the float order of the sums differs by mesh, so the scale must not.
  quarters = jnp.round(-2 * jnp.log2(peak) - jnp.log2(jnp.maximum(mean, 1e-30)))
  return jnp.where(peak > 0, jnp.exp2(quarters / 4), 1.0)


def scaled_at_birth(qs: list[jax.Array], x: jax.Array) -> list[jax.Array]:
  """A tile's Qs, those of :func:`init_qs` at :func:`first_scale` of ``x`` (the array they
  precondition) where they are born (zero: ``preconditioner_init_scale`` None), else unchanged.

  Example:
      >>> born = init_qs((2, 3), [True, False], 0.0, jnp.float32)
      >>> [q.tolist() for q in scaled_at_birth(born, jnp.full((2, 3), 16.0))]
      [[[0.5, 0.0], [0.0, 0.5]], [0.5, 0.5, 0.5]]
  """
  born = _as_vector(qs[0]).reshape(-1)[0] == 0  # A fitted Q's diagonal stays positive.
  fresh = init_qs(x.shape, [q.ndim == 2 for q in qs], first_scale(x), qs[0].dtype)
  return [jnp.where(born, f.astype(q.dtype), q) for f, q in zip(fresh, qs)]


def _apply_along(x: jax.Array, axis: int, q: jax.Array, transposed: bool = False) -> jax.Array:
  """Multiplies ``x`` by ``q`` (``q^T`` where ``transposed``) along ``axis`` (diagonal ``q`` is
  elementwise): ``y[..i..] = q[i, j] x[..j..]``. One contraction whose operands come in the
  order that leaves the result's dims in place on the first and the last axis, and ``q^T``
  read by contracting ``q``'s rows: no transpose of ``q`` or of the result is materialised.

  Example:
      >>> x, q = jnp.arange(6.0).reshape(2, 3), jnp.arange(9.0).reshape(3, 3)
      >>> [bool((y == want).all()) for y, want in (
      ...     (_apply_along(x, 1, q), x @ q.T), (_apply_along(x, 1, q, transposed=True), x @ q))]
      [True, True]
  """
  if q.ndim == 1:
    return x * jnp.expand_dims(q, range(1, x.ndim - axis))
  contracted = 0 if transposed else 1  # The dim of q that meets x's axis.
  if axis == 0:
    return jnp.tensordot(q, x, axes=(contracted, 0))
  return jnp.moveaxis(jnp.tensordot(x, q, axes=(axis, contracted)), -1, axis)


def triangular_inverse(q: jax.Array, precision=jax.lax.Precision.HIGHEST) -> jax.Array:
  """Inverse of an upper triangular ``(..., n, n)`` matrix, with matmuls only, at ``precision``
  (None: the surrounding ``jax.default_matmul_precision``).

  Blockwise doubling: ``inv([[A, B], [0, D]]) = [[iA, -iA B iD], [0, iD]]``,
  starting from the inverses of the diagonal blocks of 64 (:func:`_block_inverses`),
  log2(n / 64) batched steps (n is padded to a power of 2 with identity): each step
  is a program of its own, so fewer steps compile faster (blocks of 64 also ran fastest).
  Unlike a batched ``triangular_solve`` it calls no LAPACK kernel: jaxlib's batched CPU
  kernels split large batches over the intra-op thread pool and wait for them, which
  deadlocks when several simulated CPU devices occupy that pool.

  Example:
      >>> q = jnp.array([[2.0, 1.0, 0.0], [0.0, 1.0, 3.0], [0.0, 0.0, 4.0]])
      >>> bool(jnp.allclose(triangular_inverse(q) @ q, jnp.eye(3)))
      True
  """
  n = q.shape[-1]
  size = 1 << (n - 1).bit_length()
  pad = [(0, 0)] * (q.ndim - 2) + [(0, size - n)] * 2
  full = jnp.pad(q, pad) + jnp.diag(jnp.arange(size) >= n).astype(q.dtype)
  batch = q.shape[:-2]
  # The diagonal s-blocks: every (k + 1)-th block of the row-major grid of k x k blocks.
  diagonal = lambda s: jnp.swapaxes(
      full.reshape(*batch, size // s, s, size // s, s), -3, -2
  ).reshape(*batch, (size // s) ** 2, s, s)[..., :: size // s + 1, :, :]
  base = min(_BASE_BLOCK, size)
  matmul = functools.partial(jnp.matmul, precision=precision)
  inv = _block_inverses(diagonal(base), matmul)
  for level in range(base.bit_length() - 1, size.bit_length() - 1):
    s = 2**level
    b = diagonal(2 * s)[..., :s, s:]
    inv_a, inv_d = inv[..., 0::2, :, :], inv[..., 1::2, :, :]
    top = jnp.concatenate([inv_a, -matmul(matmul(inv_a, b), inv_d)], -1)
    bottom = jnp.concatenate([jnp.zeros_like(inv_d), inv_d], -1)
    inv = jnp.concatenate([top, bottom], -2)
  return inv[..., 0, :n, :n]


def _block_inverses(blocks: jax.Array, matmul: Callable = jnp.matmul) -> jax.Array:
  """Inverses of upper triangular ``(..., w, w)`` blocks ``D = L (I + N)`` (``L`` diagonal,
  ``N`` strictly upper, so nilpotent): ``(I - N)(I + N^2)(I + N^4)... L^-1``, its
  ``ceil(log2(w))`` factors unrolled (a loop copied its carry on every turn on TPU).

  Example:
      >>> _block_inverses(jnp.array([[[2.0, 1.0], [0.0, 4.0]]]))[0].tolist()
      [[0.5, -0.125], [0.0, 0.25]]
  """
  w = blocks.shape[-1]
  eye = jnp.eye(w, dtype=blocks.dtype)
  diagonal = jnp.sum(blocks * eye, -1)  # Masks: jnp.diagonal traces a platform-dependent cond.
  power = -(blocks - diagonal[..., None] * eye) / diagonal[..., None]
  product = eye + power
  for _ in range(1, (w - 1).bit_length()):
    power = matmul(power, power)
    product = product + matmul(product, power)
  return product / diagonal[..., None, :]


def _solve_along(x: jax.Array, axis: int, q: jax.Array, by_inverse: bool = False) -> jax.Array:
  """Right-multiplies ``x`` by ``inv(q)`` along ``axis`` (q upper triangular).

  ``by_inverse`` uses :func:`triangular_inverse` instead of LAPACK, at the surrounding matmul
  precision (the fit's ``precond_update_precision``). Psgd-jax's ``solve_triangular`` runs at
  the highest on a TPU (XLA expands it so); at TPU's "tensorfloat32" (3 bfloat16 passes) the
  inverse of a fitted Q is within 4e-6 of its largest entry, at the highest within 2e-7.
  """
  if q.ndim == 1:
    return x / jnp.expand_dims(q, range(1, x.ndim - axis))
  if by_inverse:
    return _apply_along(x, axis, triangular_inverse(q, None).astype(x.dtype), transposed=True)
  moved = jnp.moveaxis(x, axis, -1)
  flat = moved.reshape(-1, moved.shape[-1]).astype(q.dtype)
  solved = jax.lax.linalg.triangular_solve(q, flat, left_side=False, lower=False)
  return jnp.moveaxis(solved.reshape(moved.shape), -1, axis)


def _gram_along(x: jax.Array, axis: int, diagonal: bool) -> jax.Array:
  """Second moment of ``x`` along ``axis``: a (d,) vector or (d, d) matrix."""
  if diagonal:
    return jnp.sum(x * x, axis=[a for a in range(x.ndim) if a != axis])
  return gram_along(x, axis)


def _spectral_norm_lower_bound(a: jax.Array) -> jax.Array:
  """Cheap lower bound of the spectral norm of a symmetric PSD matrix.

  One power-iteration step started from the row of largest norm; psgd's
  bound (norm(a) <= sqrt(2) * bound in practice). Its scale, psgd's largest ``|a_ij|``, is
  read off the diagonal (``|a_ij| <= sqrt(a_ii a_jj)`` in a PSD matrix): no pass over ``a``.

  Example (the norm is 3):
      >>> bound = float(_spectral_norm_lower_bound(jnp.array([[2.0, 1.0], [1.0, 2.0]])))
      >>> 3 / 2**0.5 <= bound <= 3
      True
  """
  n = a.shape[-1]
  max_abs = jnp.max(jnp.abs(a[np.arange(n), np.arange(n)]))
  scaled = a / jnp.where(max_abs > 0, max_abs, 1.0)
  row = scaled[jnp.argmax(jnp.sum(scaled * scaled, axis=1))]
  x = scaled @ row
  x = x / jnp.where(jnp.any(x != 0), jnp.linalg.norm(x), 1.0)
  return max_abs * jnp.linalg.norm(scaled @ x)


def _update_q(q, term1, term2, lr):
  """One step of psgd's multiplicative Q fit: q <- q - lr * dq."""
  tiny = jnp.finfo(term1.dtype).tiny
  if q.ndim < 2:
    step = lr * (term1 - term2) / (jnp.max(jnp.abs(term1 + term2)) + tiny)
    return q - step * q
  step = lr * jnp.triu(term1 - term2)
  step = step / (_spectral_norm_lower_bound(term1 + term2) + tiny)
  return q - step @ q


def _as_vector(x):
  """Scalars are handled as 1-vectors so every code path sees ndim >= 1."""
  return x.reshape(1) if x.ndim == 0 else x


def update_qs(
    qs: list[jax.Array],
    g: jax.Array,
    v: jax.Array,
    lr: float,
    solve_by_inverse: bool = False,
):
  """Fits Q so that ``P = Q^T Q`` whitens ``g``, using the probe ``v``.

  Implements psgd's Kron update: ``A = Q g`` and ``conjB = v Q^{-1}``
  (a triangular solve per dim, or a product with :func:`triangular_inverse`
  if ``solve_by_inverse``); each factor moves along
  ``triu(A A^T - conjB^T conjB)`` normalised by a spectral-norm bound.

  Example:
      >>> qs = init_qs((3, 2), [True, True], 1.0, jnp.float32)
      >>> g = jnp.ones((3, 2)); v = jnp.ones((3, 2))
      >>> [q.shape for q in update_qs(qs, g, v, 0.1)]
      [(3, 3), (2, 2)]
  """
  shapes = [q.shape for q in qs]
  qs = [_as_vector(q) for q in qs]
  g, v = _as_vector(g), _as_vector(v)
  a, conj_b = g, v
  for axis, q in enumerate(qs):
    a = _apply_along(a, axis, q)
    conj_b = _solve_along(conj_b, axis, q, solve_by_inverse)
  new_qs = []
  for axis, q in enumerate(qs):
    term1 = _gram_along(a, axis, diagonal=q.ndim == 1)
    term2 = _gram_along(conj_b, axis, diagonal=q.ndim == 1)
    new_qs.append(_update_q(q, term1, term2, lr))
  return [q.reshape(s) for q, s in zip(new_qs, shapes)]


def precondition(qs: list[jax.Array], g: jax.Array) -> jax.Array:
  """Returns ``P g`` with ``P = kron(Q_i^T Q_i)``.

  Example:
      >>> qs = init_qs((2, 2), [True, True], 4.0, jnp.float32)
      >>> precondition(qs, jnp.ones((2, 2))).tolist()  # Q_i = 2 I, so P = 16 I
      [[16.0, 16.0], [16.0, 16.0]]
  """
  out = _as_vector(g)
  for axis, q in enumerate(qs):
    q = _as_vector(q)
    out = _apply_along(_apply_along(out, axis, q), axis, q, transposed=True)
  return out.reshape(g.shape)


def balance_qs(qs: list[jax.Array]) -> list[jax.Array]:
  """Rescales factors to equal max-abs without changing their product."""
  if len(qs) < 2:
    return qs
  norms = jnp.stack([jnp.max(jnp.abs(q)).astype(jnp.float32) for q in qs])
  gmean = jnp.prod(norms) ** (1 / len(qs))
  return [q * (gmean / n).astype(q.dtype) for q, n in zip(qs, norms)]


def _clip_rms(u: jax.Array, squares: jax.Array | None = None, max_rms: float = 1.1) -> jax.Array:
  """Preconditioned grads should have RMS ~1: cap it at ``max_rms``. ``squares``: ``u``'s sum
  of squares, where its blocks' run gave it
  (:attr:`~bv_sharding.optimizers.shard_run.BlockRun.squares`).

  Example:
      >>> u = jnp.full(4, 2.2)  # RMS 2.2: capped at 1.1
      >>> [round(float(x[0]), 4) for x in (_clip_rms(u), _clip_rms(u, jnp.sum(u * u)))]
      [1.1, 1.1]
  """
  mean = jnp.mean(jnp.square(u)) if squares is None else squares / u.size
  return u / jnp.maximum(1.0, jnp.sqrt(mean).astype(u.dtype) / max_rms)


def _probe_vectors(count: jax.Array, grads: list[jax.Array], tiled: list[bool]):
  """Step ``count``'s balancing coin and one Gaussian probe per grad, keyed as in psgd-jax
  (:func:`_coin_and_keys`): drawn whole, or, where ``tiled``, tile by tile where the tiles are
  fitted (:class:`~bv_sharding.optimizers.draws.TileNormal`)."""
  coin, keys = _coin_and_keys(count, len(grads))
  probes = [
      TileNormal(keys, i, g.dtype) if t else None for i, (g, t) in enumerate(zip(grads, tiled))
  ]
  whole = [i for i, p in enumerate(probes) if p is None]
  if whole:
    for i, v in zip(whole, normals(keys[np.array(whole)], [grads[i] for i in whole])):
      probes[i] = v
  return coin < _BALANCE_PROBABILITY, probes


def _coin_and_keys(count: jax.Array, n: int) -> tuple[jax.Array, jax.Array]:
  """Step ``count``'s balancing coin (a uniform draw) and ``n`` probe keys, psgd-jax's:
  ``fold_in(PRNGKey(seed), count)``, split (the second), split (the key, and the coin's key),
  split (the second: the probes' key), split into ``n``; the coin ``uniform(coin's key)``.

  The ``j``-th key of a split is ``fold_in(key, j)`` (threefry's partitionable split), and a
  uniform draw's 32 bits are the two words of ``fold_in(key, 0)`` xor-ed, their top 23 the
  fraction; so the chain is one loop of one ``fold_in`` over ``n + 1`` lanes, the coin's last,
  taken after its fourth turn: one threefry program where the chain's seven calls compiled one
  each (on CPU, a loop and a few kernels a call). With partitionable threefry off (jax's
  ``jax_threefry_partitionable``), the chain's calls themselves.

  Example (the chain's own calls, with partitionable threefry on and off):
      >>> def chain(count, n):
      ...   key = jax.random.split(jax.random.fold_in(jax.random.PRNGKey(_PRNG_SEED), count))[1]
      ...   key, coin_key = jax.random.split(key)
      ...   return jax.random.uniform(coin_key), jax.random.split(jax.random.split(key)[1], n)
      >>> for partitionable in (True, False):
      ...   with jax.threefry_partitionable(partitionable):
      ...     (coin, keys), (want_coin, want) = _coin_and_keys(jnp.int32(3), 2), chain(3, 2)
      ...     print(bool(coin == want_coin), bool((keys == want).all()))
      True True
      True True
  """
  seed = jax.random.PRNGKey(_PRNG_SEED)
  if not jax.config.jax_threefry_partitionable:
    key, coin = jax.random.split(jax.random.split(jax.random.fold_in(seed, count))[1])
    return jax.random.uniform(coin), jax.random.split(jax.random.split(key)[1], n)
  turns = np.zeros((4, n + 1), np.uint32)  # Each turn's data per lane, after the count's.
  turns[0] = 1  # The second of the first split.
  turns[1, n] = 1  # The key's lanes take the first of the second split, the coin the second.
  turns[2, :n] = 1  # The probes' key: the second of the third split (the coin's bits: 0).
  turns[3, :n] = np.arange(n)  # The probes: the n-way split.
  data = jnp.concatenate([jnp.full((1, n + 1), count, jnp.uint32), turns])
  fold = jax.vmap(jax.random.fold_in)

  def turn(i, carry):
    keys = fold(carry[0], data[i])
    return keys, jnp.where(i == 3, keys[n], carry[1])

  start = jnp.broadcast_to(seed, (n + 1, *seed.shape))
  keys, bits = jax.lax.fori_loop(0, len(data), turn, (start, seed))
  fraction = ((bits[0] ^ bits[1]) >> 9).astype(jnp.float32) * 2.0**-23
  return fraction, keys[:n]


def normals(keys: jax.Array, likes: list[jax.Array]) -> list[jax.Array]:
  """``jax.random.normal(keys[i], likes[i].shape, likes[i].dtype)`` for each ``i``, those of
  one shape and dtype drawn in one loop (:func:`~bv_sharding.optimizers.opaque.apart`): the
  same values, one RNG program per shape instead of one per array, and one kernel per shape
  for each that reads them.

  Example:
      >>> keys = jax.random.split(jax.random.PRNGKey(0), 3)
      >>> likes = [jnp.zeros((2, 3)), jnp.zeros(4), jnp.zeros((2, 3))]
      >>> drawn = normals(keys, likes)
      >>> bool((drawn[2] == jax.random.normal(keys[2], (2, 3))).all()), drawn[1].shape
      (True, (4,))
  """
  groups: dict[tuple, list[int]] = {}
  for i, x in enumerate(likes):
    groups.setdefault((x.shape, x.dtype), []).append(i)
  out: list = [None] * len(likes)
  for (shape, dtype), members in groups.items():
    own = keys[jnp.array(members)]
    draw = lambda j, shape=shape, dtype=dtype, own=own: jax.random.normal(own[j], shape, dtype)
    like = jax.ShapeDtypeStruct(shape, dtype)
    for i, x in zip(members, opaque.apart(draw, len(members), like)):
      out[i] = x
  return out


def leaf_tiling(
    param: jax.Array, scanned: bool, block_size: int | None, blocking: str = "tiles"
) -> Tiling | None:
  """How ``param`` is cut into blocks (:func:`~bv_sharding.optimizers.tiles.shard_blocks`), or
  None if it keeps one preconditioner computed on the whole param.

  Params with fewer than 2 dims (not counting a scanned layer axis) are not blocked. With
  ``block_size`` None a param is one tile (per layer), stored in psgd-jax's shapes
  (:class:`~bv_sharding.optimizers.placement.Tiling`): on a mesh it is fitted whole by one
  device, as the tiles that span shards are, not left to XLA's partitioner (whatever the
  ``blocking``: a whole param is the same tile on any mesh).

  Example:
      >>> leaf_tiling(jnp.ones((4, 3)), False, 2).blocks((4, 3), (), None).count
      4
      >>> leaf_tiling(jnp.ones((4, 3)), False, None).blocks((4, 3), (), None).sizes
      (4, 3)
      >>> print(leaf_tiling(jnp.ones((2, 3)), True, 2))  # 1-D per layer
      None
  """
  if param.ndim - scanned < 2:
    return None
  return Tiling(block_size, scanned, blocking=blocking if block_size else "tiles")


def _stack_shape(param, scanned: bool, blocks: ShardBlocks | None):
  """(leading dims of the stacked preconditioners, or None; shape each one preconditions)."""
  if blocks is not None:
    return blocks.grid_shape, blocks.sizes
  if scanned:
    return param.shape[:1], param.shape[1:]
  return None, param.shape


@dataclasses.dataclass(frozen=True)
class _Settings:
  """:func:`scale_by_kron`'s arguments, read by name by its init and update."""

  b1: float
  preconditioner_update_probability: Probability
  max_size_triangular: int
  min_ndim_triangular: int
  memory_save_mode: str | None
  momentum_into_precond_update: bool
  preconditioner_lr: float
  preconditioner_init_scale: float | None
  mu_dtype: Any | None
  precond_dtype: Any | None
  precond_update_precision: str | None
  precond_grads_precision: str | None
  scanned_layers: optax.Params | None
  block_size: int | None
  layout: ParamLayout | None
  blocking: str
  resident_padding: float = 0.0


def _fit_and_precondition(stored, momentum, target, probe, scalars, stacked, settings):
  """One param's (or block stack's) Kron step: balance and fit the Qs on ``target`` plus
  damping times ``probe``, keep the fit where ``do_update``, precondition ``momentum``:
  ``(the Qs as stored, the direction)``.

  ``stored``: the Qs as stored (a tile's triangular ones packed, :func:`_unpacked`);
  ``probe``: an array, or a function that draws it (called in the fit alone);
  ``scalars``: (damping, do_update, do_balance); ``stacked``: the Qs are stacks (scanned
  layers or blocks); ``settings``: a :class:`_Settings`. Stacked Qs solve with
  :func:`triangular_inverse`: jaxlib spreads a batched LAPACK solve over XLA's CPU thread
  pool and waits, which deadlocks when several (simulated) devices hold the pool's threads.
  Stacked Qs are born and fitted under ``lax.cond`` where that is safe
  (:func:`~bv_sharding.optimizers.gating.cond`), the Qs passing through it as stored and the
  fit's target formed (and a probe given as a function drawn) inside: a step that neither
  sets nor fits them reads them once, to precondition, and draws and forms nothing else.
  """
  damping, do_update, do_balance = scalars
  vmapped = lambda fn: jax.vmap(fn) if stacked else fn
  if settings.preconditioner_init_scale is None:  # Born Qs (zero) set from their momentum.
    born = lambda st, m: _repacked(vmapped(scaled_at_birth)(_unpacked(st), m), st)
    first = _first_entries(stored[0], stacked)
    stored = gating.cond(jnp.any(first == 0), born, lambda st, _: list(st), stored, momentum)

  def fitted(stored, target):
    qs, v = _unpacked(stored), probe() if callable(probe) else probe
    start = gating.cond(do_balance, vmapped(balance_qs), list, qs)  # 1 step in 100.
    with jax.default_matmul_precision(settings.precond_update_precision):
      fit = functools.partial(update_qs, lr=settings.preconditioner_lr, solve_by_inverse=stacked)
      new = vmapped(fit)(start, _damped(target, v, damping), v)
    new = [n.astype(o.dtype) for n, o in zip(new, qs)]
    return _repacked(new, stored), new

  if stacked:  # Matmuls alone: under lax.cond where that is safe, as psgd-jax fits.
    kept = lambda st, _: (list(st), _unpacked(st))  # Each side gives the Qs unpacked, once.
    stored, qs = gating.cond(do_update, fitted, kept, stored, target)
  else:
    new, _ = fitted(stored, target)
    stored = qs = [jnp.where(do_update, n, o) for n, o in zip(new, stored)]
  with jax.default_matmul_precision(settings.precond_grads_precision):
    direction = vmapped(precondition)(qs, momentum)
  return stored, direction


def _unpacked(stored: list[jax.Array]) -> list[jax.Array]:
  """Qs as stored, each triangular one of a tile's stack packed (``(n, b / 2 + 1, b)``,
  :func:`~bv_sharding.optimizers.symmetric.pack_upper`), as matrices (the others as they are).

  Example:
      >>> stored = [symmetric.pack_upper(jnp.eye(4)[None]), jnp.ones((1, 3))]
      >>> [q.shape for q in _unpacked(stored)]
      [(1, 4, 4), (1, 3)]
  """
  return [symmetric.unpack_upper(q) if q.ndim == 3 else q for q in stored]


def _repacked(qs: list[jax.Array], stored: list[jax.Array]) -> list[jax.Array]:
  """``qs`` in the form of ``stored`` (:func:`_unpacked`'s inverse): packed where it is."""
  return [q if q.shape == s.shape else symmetric.pack_upper(q) for q, s in zip(qs, stored)]


def _first_entries(q: jax.Array, stacked: bool) -> jax.Array:
  """Each tile's (or layer's) ``Q[0, 0]`` of a stored first Q (``(1,)`` if not ``stacked``),
  zero where it is born: a packed stack's last slot, one of the copies of the first number
  that :func:`~bv_sharding.optimizers.symmetric.pack` keeps there (read without unpacking).

  Example:
      >>> q = jnp.triu(jnp.arange(1.0, 17.0).reshape(4, 4))
      >>> _first_entries(symmetric.pack_upper(q)[None], True).tolist()
      [1.0]
  """
  if stacked and q.ndim == 3 and q.shape[-2] != q.shape[-1]:
    return q[:, -1, -1]
  return q.reshape(q.shape[0] if stacked else 1, -1)[:, 0]


def _damped(target: jax.Array, probe: jax.Array, damping: jax.Array) -> jax.Array:
  """``target + damping * probe``; ``damping`` a scalar or one per block of a stack."""
  damping = damping.reshape(damping.shape + (1,) * (target.ndim - damping.ndim))
  return target + damping.astype(target.dtype) * probe


def _fit_blocks(arrays, stacks, damping, *flags, own_target: bool, settings):
  """:func:`_fit_and_precondition` on block stacks, as
  :func:`~bv_sharding.optimizers.blocked.run_blocked` calls it: ``arrays`` (momentum, [target,]
  probe: drawn where it runs, a function that draws it) and ``stacks`` (the Qs, a tile's
  triangular ones packed: :func:`~bv_sharding.optimizers.symmetric.pack_upper`,
  ``(n, b / 2 + 1, b)``)."""
  m, *t, v = arrays
  (stored,) = stacks
  target = t[0] if own_target else m
  new, direction = _fit_and_precondition(stored, m, target, v, (damping, *flags), True, settings)
  return [direction], [new]


def _kron_leaf(qs, momentum, target, probe, scalars, blocks, stacked, fit, settings):
  """:func:`_fit_and_precondition` of one param: a
  :class:`~bv_sharding.optimizers.shard_run.BlockRun` of ``fit`` on its block stack
  (``blocks``, run with the other params' by ``run_blocked``), or, unblocked,
  ``(qs, direction)`` fitted on the param itself.

  ``scalars``: (damping, do_update, do_balance); the fit's target is ``target`` plus
  ``damping`` times the probe, formed where the blocks are, so that only the momentum,
  the probe and (when it is not the momentum) the target reach them.
  """
  if blocks is None:
    return _fit_and_precondition(qs, momentum, target, probe, scalars, stacked, settings)
  damping, *flags = scalars
  own_target = fit.keywords["own_target"]
  arrays = [momentum, target, probe] if own_target else [momentum, probe]
  do_update = flags[0]
  fitting = [None] + [do_update] * (len(arrays) - 1)  # The momentum is read on every step.
  return blocked.BlockRun(
      blocks, fit, arrays, [qs], [damping, *flags], fitting, [do_update], True, squares=[0]
  )


def _layers_and_blocks(params, settings) -> tuple[list[bool], list[Tiling | None], list]:
  """Per leaf of ``params``: whether it is scanned, its :func:`leaf_tiling` and its
  :class:`ShardBlocks` (both None where it is not blocked).

  ``settings``: a :class:`_Settings` (its scanned_layers, else its layout's stacked leaves,
  block_size, blocking and layout).
  """
  treedef = jax.tree.structure(params)
  leaves = treedef.flatten_up_to(params)
  if settings.scanned_layers is None:
    scanned = stacked_leaves(settings.layout, params)
  else:
    scanned = treedef.flatten_up_to(settings.scanned_layers)
  tilings = [
      leaf_tiling(p, s, settings.block_size, settings.blocking) for p, s in zip(leaves, scanned)
  ]
  return scanned, tilings, blocked.param_blocks(params, settings.layout, tilings)


def _init_leaf(
    param, scanned: bool, tiling: Tiling | None, blocks: ShardBlocks | None, settings
) -> list[jax.Array]:
  """One param's Qs (:func:`init_qs`), stacked over its layers or blocks."""
  stack, shape = _stack_shape(param, scanned, blocks)
  if blocks is not None:
    qs = _tile_qs(shape, param.dtype, tiling.block_size is not None, settings)
    return blocked.grid_stacks(qs, blocks, tiling)
  qs = _tile_qs(shape, param.dtype, False, settings)
  return qs if stack is None else [jnp.broadcast_to(q, tuple(stack) + q.shape) for q in qs]


def _tile_qs(shape, dtype, packed: bool, settings) -> list[jax.Array]:
  """The Qs of one tile (or param) of ``shape`` (:func:`init_qs`), in the Qs' dtype, the
  triangular ones stored packed where ``packed`` (a tile's; psgd-jax's shapes otherwise); zero
  with ``preconditioner_init_scale`` None (:func:`scaled_at_birth` sets them)."""
  tri = triangular_dims(
      shape, settings.max_size_triangular, settings.min_ndim_triangular, settings.memory_save_mode
  )
  dtype = dtype if settings.precond_dtype is None else settings.precond_dtype
  scale = settings.preconditioner_init_scale
  qs = init_qs(shape, tri, 0.0 if scale is None else scale, dtype)  # None: born zero.
  return [symmetric.pack_upper(q) if packed and q.ndim == 2 else q for q in qs]


def _skeletons(leaves, tilings, blocks, settings) -> tuple[Resident, ...]:
  """The pools whose Qs are kept where they run (``resident_padding``;
  :func:`~bv_sharding.optimizers.holding.held_pools`), born: each a
  :class:`~bv_sharding.optimizers.pools.Resident` of its tiles' Qs, its ``where`` its members'
  seats. Like tiles pool together only if their params' dtypes are the same (so are their
  momenta's, which the step moves to the pool with them)."""
  if not settings.resident_padding or settings.layout is None:
    return ()
  keys: dict = {}
  runs = [
      None
      if b is None
      else blocked.BlockRun(b, keys.setdefault(x.dtype, lambda: None), [], [], turnable=True)
      for x, b in zip(leaves, blocks)
  ]
  devices = holding.devices_of(settings.layout.mesh)
  out = []
  for pool, slots in holding.held_pools(runs, devices, settings.resident_padding):
    first = pool.members[0]
    packed = tilings[first].block_size is not None
    qs = _tile_qs(pool.blocks[0].sizes, leaves[first].dtype, packed, settings)
    slotted = [jnp.broadcast_to(q, (slots, *q.shape)) for q in qs]
    out.append(Resident({"qs": slotted}, holding.seats(pool)))
  return tuple(out)


def _kron_init(params, settings: _Settings) -> dict[str, Any]:
  """``scale_by_kron``'s state for ``params`` (see the module docstring); with pools kept
  where they run, a ``"pools"`` entry of them, and their members' Qs empty."""
  leaves, treedef = jax.tree.flatten(params)
  scanned, tilings, blocks = _layers_and_blocks(params, settings)
  pools = _skeletons(leaves, tilings, blocks, settings)
  held = {seat.leaf for pool in pools for seat in pool.where}
  qs = [
      Stacks([], leaf[2]) if i in held else _init_leaf(*leaf, settings)
      for i, leaf in enumerate(zip(leaves, scanned, tilings, blocks))
  ]
  state = dict(
      count=jnp.zeros([], jnp.int32),
      mu=otu.tree_zeros_like(params, dtype=settings.mu_dtype) if settings.b1 > 0 else None,
      Qs_preconditioners=treedef.unflatten(qs),
      update_counter=jnp.zeros([], jnp.int32),
  )
  return {**state, "pools": pools} if pools else state


def holds(state) -> bool:
  """Whether ``state`` is Kron's with pools kept where they run."""
  return isinstance(state, dict) and "Qs_preconditioners" in state and bool(state.get("pools"))


def given_back(state: dict, params, layout: ParamLayout) -> dict:
  """Kron's ``state`` with its pools' Qs given back to their params (each its
  :class:`~bv_sharding.optimizers.placement.Stacks`): the state without ``resident_padding``,
  the same on any mesh."""
  leaves, treedef = jax.tree.flatten(params)
  qs = treedef.flatten_up_to(state["Qs_preconditioners"])
  specs = treedef.flatten_up_to(layout.specs)
  for pool in state.get("pools", ()):
    slots = [holding.undealt_slots(q, layout.mesh) for q in pool["qs"]]
    for seat in pool.where:
      tiling = qs[seat.leaf].tiling
      blocks = tiling.blocks(leaves[seat.leaf].shape, specs[seat.leaf], layout.mesh)
      mine = [holding.member_slots(q, blocks, seat) for q in slots]
      qs[seat.leaf] = holding.stacks_from_slots(mine, blocks, seat, tiling)
  out = {k: v for k, v in state.items() if k != "pools"}
  return {**out, "Qs_preconditioners": treedef.unflatten(qs)}


def held(state: dict, params, layout: ParamLayout, like: Sequence[Resident]) -> dict:
  """Kron's ``state`` (its Qs each param's) with the pools ``like`` describes filled from their
  members' Qs, which they then keep no more (inverse of :func:`given_back`)."""
  leaves, treedef = jax.tree.flatten(params)
  qs = treedef.flatten_up_to(state["Qs_preconditioners"])
  specs = treedef.flatten_up_to(layout.specs)
  pools = []
  for pool in like:
    parts = [[] for _ in pool["qs"]]
    for seat in pool.where:
      tiling = qs[seat.leaf].tiling
      blocks = tiling.blocks(leaves[seat.leaf].shape, specs[seat.leaf], layout.mesh)
      for k, x in enumerate(holding.stacks_to_slots(qs[seat.leaf], blocks, seat)):
        parts[k].append(x)
      qs[seat.leaf] = Stacks([], tiling)
    filled = [holding.pooled(xs, y, layout.mesh) for xs, y in zip(parts, pool["qs"])]
    pools.append(Resident({"qs": filled}, pool.where))
  return {**state, "Qs_preconditioners": treedef.unflatten(qs), "pools": tuple(pools)}


def _fit_held(arrays, held_qs: Resident, damping, *flags, own_target: bool, settings):
  """:func:`_fit_blocks` on a device's slots of a pool whose Qs are kept where it runs:
  ``([direction], the slots' new Qs)``."""
  (direction,), (new,) = _fit_blocks(
      arrays, [held_qs["qs"]], damping, *flags, own_target=own_target, settings=settings
  )
  return [direction], Resident({"qs": new}, held_qs.where)


def _update_momentum(updates, mu, b1: float, count):
  """(the new ``mu``, the bias-corrected momentum); without momentum (None, ``updates``)."""
  if mu is None:
    return None, updates
  mu = otu.tree_update_moment(updates, mu, b1, 1)
  return mu, otu.tree_bias_correction(mu, b1, count)


def _count_to_update(counter: jax.Array, probability: Probability, count: jax.Array):
  """(whether Q is fitted this step, the new counter): every ``ceil(1/prob)`` steps.

  Example:
      >>> [bool(_count_to_update(jnp.int32(c), 0.5, 1)[0]) for c in range(3)]
      [False, True, True]
  """
  prob = probability(count) if callable(probability) else probability
  counter = optax.safe_increment(counter)
  do_update = counter >= 1 / prob
  return do_update, jnp.where(do_update, 0, counter)


def _damping(target: jax.Array) -> jax.Array:
  """psgd's damping of the fit's target: ``sqrt(eps) * mean|target|`` (times the probe)."""
  damp = jnp.sqrt(jnp.finfo(jnp.float32).eps)
  return damp.astype(target.dtype) * jnp.mean(jnp.abs(target))


def _kron_update(updates, state, params=None, *, settings: _Settings):
  """``scale_by_kron``'s update: momentum, a Q fit every ``ceil(1/prob)`` steps, ``P m``.
  Pools kept where they run do so on a concrete mesh; elsewhere (global arrays) the step runs
  on the state given back to the params, and the pools are kept again after."""
  del params
  pools = state.get("pools", ())
  if pools and not isinstance(settings.layout.mesh, jax.sharding.Mesh):
    bare = dataclasses.replace(settings, resident_padding=0.0)
    out, new = _kron_update(updates, given_back(state, updates, settings.layout), settings=bare)
    return out, held(new, updates, settings.layout, pools)
  count = optax.safe_increment(state["count"])
  mu, momentum = _update_momentum(updates, state["mu"], settings.b1, count)
  grads, treedef = jax.tree.flatten(updates)
  momentum = treedef.flatten_up_to(momentum)
  qs = treedef.flatten_up_to(state["Qs_preconditioners"])
  do_update, counter = _count_to_update(
      state["update_counter"], settings.preconditioner_update_probability, count
  )
  # Damping is taken on the whole target. A tiled param's probe is drawn tile by tile, where
  # the tiles are fitted, padding zero; a param of one tile draws psgd-jax's probe.
  targets = momentum if settings.momentum_into_precond_update else grads
  scanned, tilings, blocks = _layers_and_blocks(updates, settings)
  # Mesh-independent tiles draw their probes tile by tile (a pool's in place), and so does an
  # unblocked param of one tile (its draw is psgd-jax's); shard-local blocks (blocking="local"),
  # never pooled, and an unblocked scanned param (psgd-jax draws its layers as one) draw whole.
  tiled = [
      t is not None and t.blocking == "tiles" and (t.block_size is not None or not t.scanned)
      for t in tilings
  ]
  do_balance, probes = _probe_vectors(state["count"], targets, tiled)
  # The fit's target is its own array unless it is the momentum (or, without momentum, the grad).
  own_target = settings.b1 > 0 and not settings.momentum_into_precond_update
  fit = functools.partial(_fit_blocks, own_target=own_target, settings=settings)
  pool_of = {seat.leaf: k for k, pool in enumerate(pools) for seat in pool.where}
  # One function per pool: its runs pool together, as the state's pools; only the Qs stay.
  fits = [functools.partial(_fit_held, own_target=own_target, settings=settings) for _ in pools]
  leaves = [
      _kron_leaf(
          q, m, t, v, (_damping(t), do_update, do_balance), b, s or b is not None, fit, settings
      )
      for q, m, t, v, s, b in zip(qs, momentum, targets, probes, scanned, blocks)
  ]
  for i, k in pool_of.items():
    leaves[i] = leaves[i]._replace(fn=fits[k], stacks=[], write_when=(), resident=pools[k])
  ran = blocked.run_blocked([x if isinstance(x, blocked.BlockRun) else None for x in leaves])
  new_qs, out, new_pools = [], [], list(pools)
  for i, (leaf, result, g) in enumerate(zip(leaves, ran, grads)):
    squares, q = None, qs[i]
    if result is None:
      q, direction = leaf
    elif i in pool_of:
      (direction, squares), new_pools[pool_of[i]] = result
    else:
      (direction, squares), (q,) = result
    new_qs.append(q)
    out.append(_clip_rms(direction, squares).astype(g.dtype))
  new_state = dict(
      count=count,
      mu=otu.tree_cast(mu, settings.mu_dtype),
      Qs_preconditioners=treedef.unflatten(new_qs),
      update_counter=counter,
  )
  return treedef.unflatten(out), {**new_state, "pools": tuple(new_pools)} if pools else new_state


def scale_by_kron(
    b1: float = 0.9,
    preconditioner_update_probability: Probability = precond_update_prob_schedule(),
    max_size_triangular: int = 8192,
    min_ndim_triangular: int = 2,
    memory_save_mode: str | None = None,
    momentum_into_precond_update: bool = True,
    preconditioner_lr: float = 0.1,
    preconditioner_init_scale: float | None = None,
    mu_dtype: Any | None = None,
    precond_dtype: Any | None = None,
    precond_update_precision: str | None = "tensorfloat32",
    precond_grads_precision: str | None = None,
    scanned_layers: optax.Params | None = None,
    block_size: int | None = 256,
    layout: ParamLayout | None = None,
    blocking: str = "tiles",
    resident_padding: float = 0.0,
) -> optax.GradientTransformation:
  """PSGD Kron preconditioning (without learning rate), psgd-jax compatible.

  Args:
    b1: momentum (0 disables it; ``mu`` is then None).
    preconditioner_update_probability: float or schedule of the step; Q is
      updated every ``ceil(1/prob)`` steps (deterministic counter).
    max_size_triangular: dims larger than this get a diagonal Q.
    min_ndim_triangular: params with fewer dims get diagonal Qs only.
    memory_save_mode: None, "one_diag" (largest dim diagonal) or "all_diag".
    momentum_into_precond_update: fit Q to the momentum instead of the grad.
    preconditioner_lr: step size of the Q fit.
    preconditioner_init_scale: initial ``Q = scale**(1/ndim) * I`` per dim (1.0: psgd-jax
      0.2.9's default). None: each tile's Qs are born zero and set on its first update
      from the momentum they precondition (:func:`first_scale`), so that the first
      updates' RMS is about Adam's at any gradient scale.
    mu_dtype, precond_dtype: storage dtypes of momentum and Qs.
    precond_update_precision, precond_grads_precision: matmul precision of
      the Q fit / of preconditioning.
    scanned_layers: pytree of bools like params; a True leaf has a leading
      layer axis that gets its own Qs (stacked as ``(L, d, d)``). None: the
      ``layout``'s ``stacked`` leaves, if it has them.
    block_size: if set, params with >= 2 (per-layer) dims are split into
      blocks of at most this size per dim, each with its own Qs (stacked as
      ``(n_blocks, b, b)``); None: each such param is one block, its Qs in
      psgd-jax's shapes; see the module docstring. 256: the param's fixed tiles on any mesh,
      14.9x less update traffic than psgd-jax's Kron under llm-jax's placement (the
      project's communication benchmark); on the tuning split of the project's small
      language model (two seeds) 128 ends 0.008 ± 0.007 below 256.
    layout: the params' specs and mesh (:class:`ParamLayout`); blocks inside one
      device's shard are fitted there, the others by owners (see
      :mod:`bv_sharding.optimizers.layout`).
    blocking: "tiles" (each param's fixed grid of ``block_size`` tiles on any
      mesh: the same math on any device count) or "local" (each device's shard
      cut into blocks of ``min(block_size, local extent)``: no collective, the
      math depends on the mesh).
    resident_padding: a pool of tiles whose slots (its tiles padded to a multiple of the
      device count) are at most this many times its tiles keeps its Qs on the devices that
      run them (:mod:`~bv_sharding.optimizers.holding`: a ``"pools"`` entry in the state,
      its members' Qs empty) instead of moving them there and back each step: fewer bytes
      on a fit step and a smaller program (lm medium's step: 26,338 instructions rather than
      28,951, and 1.78x adamw's compile seconds). The state's shapes then depend on the
      mesh (:func:`~bv_sharding.optimizers.portable.canonical_state` gives it in the form
      that does not). 0 (the default, a state any mesh resumes): no pool does. Use 1.5
      where checkpoints store the state given back (``canonical_state``).

  Example:
      >>> tx = scale_by_kron(preconditioner_update_probability=1.0, block_size=None)
      >>> state = tx.init({"w": jnp.ones((2, 3, 4))})
      >>> sorted(state)
      ['Qs_preconditioners', 'count', 'mu', 'update_counter']
      >>> state = scale_by_kron(block_size=2).init({"w": jnp.ones((2, 3, 4))})
      >>> [q.shape for q in state["Qs_preconditioners"]["w"]]  # 1 x 2 x 2 blocks
      [(1, 2, 2, 2, 2), (1, 2, 2, 2, 2), (1, 2, 2, 2, 2)]
  """
  settings = _Settings(**locals())  # First: the arguments, each under its own name.
  if block_size is not None and block_size < 1:
    raise OptimizerError(f"block_size={block_size}; expected None or >= 1")
  return blocked.transformation(_kron_init, _kron_update, settings)


def kron(
    learning_rate: optax.ScalarOrSchedule = 0.001,
    b1: float = 0.9,
    weight_decay: float = 0.0,
    mask: Any | None = None,
    preconditioner_update_probability: Probability = precond_update_prob_schedule(),
    max_size_triangular: int = 8192,
    min_ndim_triangular: int = 2,
    memory_save_mode: str | None = None,
    momentum_into_precond_update: bool = True,
    preconditioner_lr: float = 0.1,
    preconditioner_init_scale: float | None = None,
    mu_dtype: Any | None = None,
    precond_dtype: Any | None = None,
    precond_update_precision: str | None = "tensorfloat32",
    precond_grads_precision: str | None = None,
    scanned_layers: optax.Params | None = None,
    block_size: int | None = 256,
    layout: ParamLayout | None = None,
    blocking: str = "tiles",
    resident_padding: float = 0.0,
) -> optax.GradientTransformation:
  """PSGD Kron with decoupled weight decay and a learning rate.

  Arguments are those of :func:`scale_by_kron` plus ``learning_rate``,
  ``weight_decay`` and ``mask`` (pytree of bools or callable selecting the
  params that get weight decay).

  Example:
      >>> opt = kron(3e-4, weight_decay=0.1, preconditioner_update_probability=1.0)
      >>> state = opt.init({"w": jnp.ones((2, 2))})
  """
  return blocked.with_learning_rate(
      scale_by_kron(
          b1=b1,
          preconditioner_update_probability=preconditioner_update_probability,
          max_size_triangular=max_size_triangular,
          min_ndim_triangular=min_ndim_triangular,
          memory_save_mode=memory_save_mode,
          momentum_into_precond_update=momentum_into_precond_update,
          preconditioner_lr=preconditioner_lr,
          preconditioner_init_scale=preconditioner_init_scale,
          mu_dtype=mu_dtype,
          precond_dtype=precond_dtype,
          precond_update_precision=precond_update_precision,
          precond_grads_precision=precond_grads_precision,
          scanned_layers=scanned_layers,
          block_size=block_size,
          layout=layout,
          blocking=blocking,
          resident_padding=resident_padding,
      ),
      learning_rate,
      weight_decay,
      mask,
  )
