"""SOAP: Adam in the eigenbasis of Shampoo's preconditioner, on Shampoo's tiles.

SOAP (Vyas et al. 2024, arXiv 2409.11321; reference implementation github nikhilvyas/SOAP)
keeps Shampoo's statistics ``S_i = EMA(G_(i) G_(i)^T)`` (decay ``shampoo_beta``) for each
dim of a block, their eigenbases ``Q_i``, and runs Adam on the gradient rotated into them
(``Q_i^T`` along each dim); Adam's direction is rotated back (``Q_i``). The first step only
fits the statistics and takes their ``eigh`` (no update, as the reference: the projection
never uses the current gradient). A state born mid-run (another optimizer's run continued
with SOAP: :func:`~bv_sharding.optimizers.rebirth.reborn`) has count 1 and moves from its
first step: Adam's first step in the bases it is born with (``I``), then the bases fitted to
that gradient's statistics, as for any block whose statistics were zero until then, and its
moments (that gradient's alone) re-expressed in them. Every ``precondition_frequency`` steps
the bases are refreshed by one power iteration and a QR (``Q <- qr(S Q)``, the columns first
sorted by their estimated eigenvalue and Adam's second moment permuted with them) and the
first moment is carried into the new basis. With ``power_damping`` the bases instead follow the
statistics continuously, so that another mesh's rounding does not choose them: power
iterations from ``I`` fit them and one more refreshes them, on damped statistics, the columns
never re-sorted (:func:`_power_refit`). A dim larger than ``max_precond_dim`` is not
rotated, nor is a 1-D param unless ``precondition_1d`` (it trains with Adam); ``merge_dims``
first merges neighbouring dims while their product stays within ``max_precond_dim``.

The blocks are Shampoo's (:func:`~bv_sharding.optimizers.shampoo.factor_tiling`: unit dims
dropped, dims cut into ``block_size`` tiles, the same tiles on any mesh), run where they live
by :func:`~bv_sharding.optimizers.blocked.run_blocked`. The padding of a partial tile is kept
out of the basis: zero rows of a statistic get eigenvalue -1 (``_separated``), so each basis
is the real coordinates' basis plus the padding's own, sorted last, and the rotated moments
stay param-shaped.

State::

    SoapState(
        count=int32[],
        per_param=<params-like tree of> SoapParamState(
            stats=Stacks[(*grid, b_i / 2 + 1, b_i) per rotated dim],  # float32, born 0,
                                                      # packed (shampoo.py); b_i odd or 2:
                                                      # (b_i, b_i)
            bases=Stacks[(*grid, b_i, b_i) per rotated dim],  # float32, born I
            mu=<like param>,   # Adam's moments in the rotated basis: the param's dtype,
            nu=<like param>))  # bfloat16 allowed (config.state_dtype)

``stats`` and ``bases`` are float32 whatever the params' dtype, and stay float32 under
:func:`~bv_sharding.optimizers.state_dtype.with_state_dtype`: each step rotates the first
moment out of and back into the bases, which must stay orthonormal to float32 precision, and
the statistics' eigenvectors need more than bfloat16's 8 bits. ``mu`` and ``nu`` are Adam's
moments (rotated) and may be stored in bfloat16 as Adam's are. The bases' ``qr`` and ``eigh``
run in float32, under ``lax.cond``: only on a refresh step, and on a step some block's
statistics become nonzero for the first time (a block no gradient reaches, as an embedding's
rows of tokens the data never holds, is fitted on none). Each call takes one matrix
(``lax.map``): a batched LAPACK call waits on XLA's CPU thread pool, which deadlocks with
several devices (``shampoo.py``).

Example:
    >>> import jax.numpy as jnp
    >>> opt = soap(3e-3, block_size=4)
    >>> state = opt.init({"w": jnp.ones((8, 3)), "b": jnp.ones(3)})
    >>> [s.shape for s in state[0].per_param["w"].bases], state[0].per_param["b"].bases
    ([(2, 1, 4, 4), (2, 1, 3, 3)], Stacks([], Tiling(block_size=4, ...)))
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from bv_sharding.errors import OptimizerError
from bv_sharding.optimizers import blocked, gating, holding, symmetric
from bv_sharding.optimizers.layout import ParamLayout, param_placers, stacked_leaves
from bv_sharding.optimizers.placement import Stacks, Tiling
from bv_sharding.optimizers.pools import Resident
from bv_sharding.optimizers.shampoo import factor_tiling
from bv_sharding.optimizers.shard_run import BlockRun
from bv_sharding.optimizers.tensor_ops import gram_along, matmul_along
from bv_sharding.optimizers.tiles import ShardBlocks

# SOAP's learning rate over AdamW's: big_vision's ``config.lr`` for ``bv_sharding.scale_by_soap``
# is AdamW's times it (the project's registry multiplies its lr by it too). On the tuning split
# of the project's small language model (two seeds, ``docs/optimizers.md``): eval loss 1.700 at 1,
# 1.602 at 2, 1.644 at 4.
LR_SCALE = 2.0


class SoapParamState(NamedTuple):
  """Per-parameter SOAP state; see the module docstring."""

  stats: Stacks
  bases: Stacks
  mu: jax.Array
  nu: jax.Array


class SoapState(NamedTuple):
  """``count`` (steps taken, the first one included), the per-param states and, with
  ``resident``, the pools' states (:class:`~bv_sharding.optimizers.pools.Resident`)."""

  count: jax.Array
  per_param: Any
  pools: tuple = ()


def merged_shape(shape, max_precond_dim: int) -> tuple[int, ...]:
  """``shape`` with neighbouring dims merged while their product stays within
  ``max_precond_dim`` (the reference's ``merge_dims``).

  Example:
      >>> merged_shape((2, 3, 6), 8), merged_shape((4, 16), 8), merged_shape((2, 2, 2), 100)
      ((6, 6), (4, 16), (8,))
  """
  return tuple(math.prod(shape[a:b]) for a, b in _merged_groups(tuple(shape), max_precond_dim))


def _merged_groups(shape, max_precond_dim: int) -> list[tuple[int, int]]:
  """The ``[start, stop)`` dims each merged dim of :func:`merged_shape` gathers."""
  groups, start, size = [], 0, 1
  for i, d in enumerate(shape):
    if size * d <= max_precond_dim:
      size *= d
      continue
    if size > 1:
      groups.append((start, i))
      start, size = i, d
    else:
      groups.append((start, i + 1))
      start, size = i + 1, 1
  if size > 1 or not groups:
    groups.append((start, len(shape)))
  return [(a, b) for a, b in groups if a < b] or [(0, len(shape))]


def merged_spec(shape, spec, max_precond_dim: int) -> tuple:
  """The spec of :func:`merged_shape`'s dims: each merged dim sharded as its first dim.

  Raises:
    OptimizerError: a merged dim's other dims sharded (its shards are not a reshape away).

  Example:
      >>> merged_spec((2, 3, 6), ("data", None, None), 8)
      ('data', None)
  """
  spec = tuple(spec) + (None,) * (len(shape) - len(tuple(spec)))
  out = []
  for a, b in _merged_groups(tuple(shape), max_precond_dim):
    if any(e is not None for e in spec[a + 1 : b]):
      raise OptimizerError(
          f"merge_dims: dims {a}..{b - 1} of a {tuple(shape)} param sharded as {spec} merge into "
          "one, and only its first dim may be sharded; set merge_dims=False"
      )
    out.append(spec[a] if a < len(spec) else None)
  return tuple(out)


@dataclasses.dataclass(frozen=True)
class MergedTiling(Tiling):
  """Shampoo's :class:`~bv_sharding.optimizers.placement.Tiling` of the param with its dims
  first merged (:func:`merged_shape`), for ``merge_dims``.

  Example:
      >>> MergedTiling(4, deal=True, unit_dims_dropped=True, max_precond_dim=8).blocks(
      ...     (2, 3, 6), (), None).sizes
      (4, 4)
  """

  max_precond_dim: int = 10000

  def blocks(self, shape, spec, mesh) -> ShardBlocks:
    layers = int(self.scanned)  # A stack of layers keeps its layer axis; each layer is merged.
    spec = tuple(spec) + (None,) * (len(shape) - len(tuple(spec)))
    merged = merged_shape(tuple(shape[layers:]), self.max_precond_dim)
    merged_of = merged_spec(shape[layers:], spec[layers:], self.max_precond_dim)
    return super().blocks((*shape[:layers], *merged), (*spec[:layers], *merged_of), mesh)


@dataclasses.dataclass(frozen=True)
class _Settings:
  """:func:`scale_by_soap`'s arguments, read by name by its init and update."""

  betas: tuple[float, float]
  shampoo_beta: float
  eps: float
  precondition_frequency: int
  max_precond_dim: int
  merge_dims: bool
  precondition_1d: bool
  normalize_grads: bool
  correct_bias: bool
  block_size: int
  layout: ParamLayout | None
  blocking: str
  resident_padding: float = 0.0
  power_damping: float = 0.0
  relative_eps: float = 0.0


def _tiling(settings: _Settings, scanned: bool = False) -> Tiling:
  tiling = factor_tiling(settings.block_size, settings.blocking, scanned)
  if not settings.merge_dims:
    return tiling
  return MergedTiling(**dataclasses.asdict(tiling), max_precond_dim=settings.max_precond_dim)


def rotated_dims(shape, max_precond_dim: int, merge_dims=False, precondition_1d=False):
  """The dims SOAP rotates of a param of ``shape``, counted among the dims it blocks (merged
  with ``merge_dims``, unit dims dropped): those within ``max_precond_dim``; none of a 1-D
  param unless ``precondition_1d``.

  Example:
      >>> rotated_dims((3, 1, 16), 8), rotated_dims((5,), 8), rotated_dims((5,), 8, False, True)
      ((0,), (), (0,))
  """
  if len(shape) == 1 and not precondition_1d:
    return ()
  if merge_dims and len(shape) > 1:
    shape = merged_shape(shape, max_precond_dim)
  kept = [d for d in shape if d > 1]
  return tuple(i for i, d in enumerate(kept) if d <= max_precond_dim)


def _leaf_plans(params, settings: _Settings) -> list[tuple[ShardBlocks | None, tuple, Tiling]]:
  """Each leaf's (blocks, rotated dims, tiling); blocks None where no dim is rotated. A stack of
  layers (the layout's ``stacked``) is cut and rotated layer by layer."""
  leaves = jax.tree.leaves(params)
  stacked = stacked_leaves(settings.layout, params)
  dims = [
      rotated_dims(
          x.shape[int(s) :], settings.max_precond_dim, settings.merge_dims, settings.precondition_1d
      )
      for x, s in zip(leaves, stacked)
  ]
  tilings = [_tiling(settings, s) for s in stacked]
  rotated = [t if d else None for t, d in zip(tilings, dims)]
  return list(zip(blocked.param_blocks(params, settings.layout, rotated), dims, tilings))


def _born_factors(sizes, dims) -> tuple[list[jax.Array], list[jax.Array]]:
  """One tile's statistics (0, packed) and bases (I), float32, per rotated dim."""
  eyes = [jnp.eye(sizes[d], dtype=jnp.float32) for d in dims]
  return [symmetric.pack(jnp.zeros_like(e)) for e in eyes], eyes


def _init_leaf(param, blocks: ShardBlocks | None, dims, tiling: Tiling) -> SoapParamState:
  """One param's state: statistics 0 and bases I (float32), zero moments like the param."""
  stats, bases = _born_factors(blocks.sizes, dims) if dims else ([], [])
  stacks = lambda xs: blocked.grid_stacks(xs, blocks, tiling) if dims else Stacks([], tiling)
  return SoapParamState(
      stats=stacks(stats), bases=stacks(bases), mu=jnp.zeros_like(param), nu=jnp.zeros_like(param)
  )


def _skeletons(leaves, plans, settings: _Settings) -> tuple[Resident, ...]:
  """The shapes of the pools whose state is kept where they run (``resident_padding``;
  :func:`~bv_sharding.optimizers.holding.held_pools`): each a
  :class:`~bv_sharding.optimizers.pools.Resident` of ``ShapeDtypeStruct``s, its ``where``
  the dims it rotates and its members' seats."""
  if not settings.resident_padding or settings.layout is None:
    return ()
  fns: dict[tuple, Any] = {}  # Like tiles pool together only if their work is the same.
  runs = [
      None
      if not dims
      else BlockRun(blocks, fns.setdefault(dims, lambda: None), [], [], turnable=dims == (0, 1))
      for _, (blocks, dims, _) in zip(leaves, plans)
  ]
  devices = holding.devices_of(settings.layout.mesh)
  out = []
  for pool, slots in holding.held_pools(runs, devices, settings.resident_padding):
    dims, tile = plans[pool.members[0]][1], pool.blocks[0].sizes
    dtypes = {leaves[i].dtype for i in pool.members}
    dtype = dtypes.pop() if len(dtypes) == 1 else jnp.float32
    stats, bases = jax.eval_shape(lambda tile=tile, dims=dims: _born_factors(tile, dims))
    slotted = lambda x, slots=slots: jax.ShapeDtypeStruct((slots, *x.shape), x.dtype)
    moment = jax.ShapeDtypeStruct((slots, *tile), dtype)
    arrays = dict(mu=moment, nu=moment, stats=[*map(slotted, stats)], bases=[*map(slotted, bases)])
    out.append(Resident(arrays, (dims, holding.seats(pool))))
  return tuple(out)


def _member_blocks(state: SoapParamState, shape, spec, layout: ParamLayout) -> ShardBlocks:
  """A param's blocks, cut as its state's stacks say, on ``layout``'s mesh."""
  return state.stats.tiling.blocks(shape, spec, layout.mesh)


def held(state: SoapState, params, layout: ParamLayout, like: Sequence[Resident]) -> SoapState:
  """``state`` (its pools given back to their params) with the pools ``like`` describes (their
  ``where``, slots and dtypes; arrays or shapes) filled from its members' state, which they
  then keep no more (their stacks empty, their moments None)."""
  leaves, treedef = jax.tree.flatten(params)
  per_param = treedef.flatten_up_to(state.per_param)
  specs = treedef.flatten_up_to(layout.specs)
  pools = []
  for pool in like:
    dims, where = pool.where
    parts = dict(mu=[], nu=[], stats=[[] for _ in dims], bases=[[] for _ in dims])
    for seat in where:
      s, x = per_param[seat.leaf], leaves[seat.leaf]
      blocks = _member_blocks(s, x.shape, specs[seat.leaf], layout)
      for key in ("mu", "nu"):
        parts[key].append(holding.to_slots(getattr(s, key), blocks, seat))
      for key in ("stats", "bases"):
        for k, slots in enumerate(holding.stacks_to_slots(getattr(s, key), blocks, seat)):
          parts[key][k].append(slots)
      per_param[seat.leaf] = _emptied(s.stats.tiling)
    filled = lambda xs, like: holding.pooled(xs, like, layout.mesh)
    arrays = {
        key: [filled(xs, y) for xs, y in zip(parts[key], pool[key])]
        if isinstance(pool[key], list)
        else filled(parts[key], pool[key])
        for key in pool
    }
    pools.append(Resident(arrays, pool.where))
  return SoapState(state.count, treedef.unflatten(per_param), tuple(pools))


def _emptied(tiling: Tiling) -> SoapParamState:
  """A param's own state where its pool holds it: no stacks, no moments."""
  return SoapParamState(Stacks([], tiling), Stacks([], tiling), None, None)


def given_back(state: SoapState, params, layout: ParamLayout) -> SoapState:
  """``state`` with its pools given back to their params: the state with no pool kept where it
  runs, the same on any mesh (inverse of :func:`held`)."""
  leaves, treedef = jax.tree.flatten(params)
  per_param = treedef.flatten_up_to(state.per_param)
  specs = treedef.flatten_up_to(layout.specs)
  for pool in state.pools:
    _, where = pool.where
    pool = jax.tree.map(lambda y: holding.undealt_slots(y, layout.mesh), pool)
    for seat in where:
      s, x = per_param[seat.leaf], leaves[seat.leaf]
      blocks = _member_blocks(s, x.shape, specs[seat.leaf], layout)
      per_param[seat.leaf] = _member_state(pool, seat, blocks, s.stats.tiling, x.shape)
  return SoapState(state.count, treedef.unflatten(per_param))


def _member_state(pool: Resident, seat: holding.Seat, blocks, tiling, shape) -> SoapParamState:
  """One member's state, read from its slots of ``pool``."""
  mine = lambda y: holding.member_slots(y, blocks, seat)
  moment = lambda y: holding.from_slots(mine(y), blocks, seat, shape)
  stacks = lambda ys: holding.stacks_from_slots([mine(y) for y in ys], blocks, seat, tiling)
  return SoapParamState(
      stacks(pool["stats"]), stacks(pool["bases"]), moment(pool["mu"]), moment(pool["nu"])
  )


def _born_pool(like: Resident) -> Resident:
  """A pool's state as :func:`_init_leaf` gives its members': statistics 0, bases I, moments 0."""
  dims, _ = like.where
  tile = like["mu"].shape[1:]
  stats, bases = _born_factors(tile, dims)
  slotted = lambda x, like: jnp.broadcast_to(x, like.shape)
  arrays = dict(
      mu=jnp.zeros(like["mu"].shape, like["mu"].dtype),
      nu=jnp.zeros(like["nu"].shape, like["nu"].dtype),
      stats=[slotted(x, y) for x, y in zip(stats, like["stats"])],
      bases=[slotted(x, y) for x, y in zip(bases, like["bases"])],
  )
  return Resident(arrays, like.where)


def _soap_init(params, settings: _Settings) -> SoapState:
  """``scale_by_soap``'s state for ``params``: every param's own, and each pool kept where it
  runs (:func:`_skeletons`) born as its members' would be, who then keep none."""
  leaves, treedef = jax.tree.flatten(params)
  plans = _leaf_plans(params, settings)
  pools = _skeletons(leaves, plans, settings)
  members = {seat.leaf for pool in pools for seat in pool.where[1]}
  per_param = [
      _emptied(plan[2]) if i in members else _init_leaf(p, *plan)
      for i, (p, plan) in enumerate(zip(leaves, plans))
  ]
  return SoapState(
      jnp.zeros([], jnp.int32),
      treedef.unflatten(per_param),
      tuple(_born_pool(pool) for pool in pools),
  )


def _rotate(x: jax.Array, bases, dims, back: bool) -> jax.Array:
  """A block stack ``(n, *tile)`` in the bases (``Q^T`` along each rotated dim), or back
  (``Q``).

  Example:
      >>> q = jnp.array([[[0.0, 1.0], [1.0, 0.0]]])
      >>> _rotate(jnp.array([[1.0, 2.0]]), [q], (0,), back=False).tolist()
      [[2.0, 1.0]]
  """

  def one(x, *qs):
    for d, q in zip(dims, qs):
      x = matmul_along(x, d, q if back else q.T)
    return x

  return jax.vmap(one)(x, *bases)


def _separated(stats: jax.Array) -> jax.Array:
  """A stack of statistics with each zero row's diagonal set to -1: a partial tile's padding
  (and any dead row) gets its own eigenvectors, sorted after every real one.

  Example:
      >>> _separated(jnp.array([[[2.0, 0.0], [0.0, 0.0]]])).tolist()
      [[[2.0, 0.0], [0.0, -1.0]]]
  """
  dead = jnp.all(stats == 0, axis=-1)
  return stats - jax.vmap(jnp.diag)(dead.astype(stats.dtype))


def canonical(stats: jax.Array, values: jax.Array, basis: jax.Array) -> jax.Array:
  """``basis`` (a statistic's eigenvectors, columns in order of their ``values``, largest
  first) with the choices ``eigh`` and QR leave to chance made the same way every time.

  Where eigenvalues coincide their eigenvectors are any basis of one subspace, and Adam then
  moves every rotated coordinate by about the learning rate, so SOAP's step would follow the
  choice. Here a run of equal eigenvalues is one cluster, and its basis is fixed by the
  subspace alone: a fixed Gaussian matrix's columns projected onto it and orthonormalised (QR,
  positive diagonal). A coordinate whose statistic row is zero (a partial tile's padding, an
  embedding row no token has reached) keeps its own unit vector, after every other, and no
  other column touches it. Eigenvalues that only nearly coincide still turn with float
  rounding; ``power_damping``'s bases do not (:func:`_power_refit`).

  Example:
      >>> s = jnp.diag(jnp.array([2.0, 1.0, 1.0, 0.0]))  # a double eigenvalue and a zero row
      >>> turned = jnp.array([[1, 0, 0, 0], [0, 0.6, 0.8, 0], [0, -0.8, 0.6, 0], [0, 0, 0, 1.0]])
      >>> a = canonical(s, jnp.array([2.0, 1, 1, -1]), jnp.eye(4))
      >>> b = canonical(s, jnp.array([2.0, 1, 1, -1]), turned)
      >>> bool(jnp.allclose(a, b, atol=1e-6)), a[:, 3].tolist()
      (True, [0.0, 0.0, 0.0, 1.0])
  """
  n = stats.shape[-1]
  live = ~jnp.all(stats == 0, axis=-1)
  live_columns = values > -0.5  # _separated gives each zero row the eigenvalue -1.
  cut = values[:-1] > values[1:]
  cluster = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(cut.astype(jnp.int32))])
  same = (cluster[:, None] == cluster[None, :]) & live_columns[:, None] & live_columns[None, :]
  grouped = jnp.sum(same, axis=0) > 1
  dead_first = jnp.argsort(live, stable=True)
  units = jnp.arange(n)[:, None] == dead_first[(jnp.arange(n) - jnp.sum(live)) % n][None, :]
  basis = jnp.where(live[:, None], basis, 0.0)
  probe = jnp.asarray(_probe(n), basis.dtype)
  projected = basis @ jnp.where(same, basis.T @ probe, 0.0)
  units = units.astype(basis.dtype)
  q = _positive_qr(jnp.where(grouped, projected, jnp.where(live_columns, basis, units)))
  return jnp.where(live_columns, jnp.where(live[:, None], q, 0.0), units)


@functools.cache
def _probe(n: int) -> np.ndarray:
  """:func:`canonical`'s fixed Gaussian ``n x n`` matrix (``jax.random.normal`` of key 0),
  drawn once, eagerly, on a thread of its own (outside whatever trace, mesh or ``shard_map``
  asked for it): a constant of the compiled step rather than a random number program in it.

  The draw's own transfers (the key in, the matrix out) are allowed on that thread: big_vision's
  ``train.py`` disallows implicit transfers globally, which reaches every thread.

  Example:
      >>> _probe(2).shape, _probe(2).dtype
      ((2, 2), dtype('float32'))
  """

  def draw():
    with jax.transfer_guard("allow"):
      return np.asarray(jax.random.normal(jax.random.PRNGKey(0), (n, n), jnp.float32))

  with concurrent.futures.ThreadPoolExecutor(1) as thread:
    return thread.submit(draw).result()


FIT_ITERATIONS = 3  # Power iterations from I that fit a block's first bases (power_damping).


def _damped(stats: jax.Array, damping: float) -> jax.Array:
  """A statistic plus ``damping`` times its largest diagonal entry on the diagonal: full rank
  wherever it is not zero, so that a QR of it times a basis is continuous in both.

  Example:
      >>> _damped(jnp.diag(jnp.array([4.0, 0.0])), 0.5).tolist()
      [[6.0, 0.0], [0.0, 2.0]]
  """
  top = jnp.max(jnp.diagonal(stats, axis1=-2, axis2=-1), axis=-1)[..., None, None]
  return stats + damping * top * jnp.eye(stats.shape[-1], dtype=stats.dtype)


def _power_step(damped: jax.Array, basis: jax.Array) -> jax.Array:
  """One power iteration and QR, ``qr(S Q)``, each column's sign kept where it points (the
  diagonal of R made positive): the new basis moves as little as ``S`` and ``Q`` do.

  Example:
      >>> s = jnp.array([[2.0, 1.0], [1.0, 2.0]])  # eigenvectors (1, 1) and (1, -1) / sqrt 2
      >>> q = jnp.eye(2)
      >>> for _ in range(20):
      ...     q = _power_step(s, q)
      >>> jnp.round(q * jnp.sqrt(2.0), 3).tolist()
      [[1.0, -1.0], [1.0, 1.0]]
  """
  return _positive_qr(damped @ basis)


def _positive_qr(x: jax.Array) -> jax.Array:
  """The Q of ``x``'s QR with R's diagonal made non-negative: each column's sign is where
  ``x``'s column points, not where the factorisation's rounding leaves it.

  Example:
      >>> _positive_qr(jnp.array([[-2.0, 0.0], [0.0, 3.0]])).tolist()
      [[-1.0, 0.0], [0.0, 1.0]]
  """
  q, r = jnp.linalg.qr(x)
  return q * jnp.where(jnp.diagonal(r) < 0, -1.0, 1.0)


def _power_refit(stats, basis, unfit, refresh, damping: float):
  """:func:`_refit` with ``power_damping``: a block whose statistics become nonzero this
  step gets :data:`FIT_ITERATIONS` power steps from ``I``, on a refresh step every other block
  one from its bases, both on the statistics :func:`_damped`; no column is re-sorted, so
  ``nu`` stays as it is. Every new basis is a continuous function of the statistics and the
  old basis: another mesh's rounding of the gradient moves it by about as much, where
  ``eigh`` and the sort would turn it freely among nearly equal eigenvalues.

  Example:
      >>> s = jnp.diag(jnp.array([1.0, 4.0, 0.0]))[None]  # The zero row keeps its unit vector.
      >>> q = _power_refit(s, jnp.eye(3)[None], jnp.array([True]), False, 1e-2)
      >>> jnp.abs(q[0]).tolist()
      [[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]
  """

  def one(s, old, unfit):
    def fit():
      q = jnp.eye(s.shape[-1], dtype=s.dtype)
      for _ in range(FIT_ITERATIONS):
        q = _power_step(s, q)
      return q

    new = gating.cond(unfit, fit, lambda: _power_step(s, old))
    return jnp.where(unfit | refresh, new, old)

  return jax.lax.map(lambda a: one(*a), (_damped(stats, damping), basis, unfit))


def _refit(stats, basis, nu, dim: int, unfit, refresh):
  """One rotated dim's new bases and ``nu``: a block whose statistics become nonzero this step
  (``unfit``) gets its statistics' eigenvectors (``eigh``, largest eigenvalue first); on a
  refresh step every other block gets ``qr(S Q)``, ``Q``'s columns first sorted by their
  estimated eigenvalue (largest first, ties in their order) and ``nu`` permuted along ``dim``
  (of its tile) with them; the rest keep theirs. New bases are made :func:`canonical`. One
  program a block (``lax.map``, as Shampoo's roots).

  Example:
      >>> s = jnp.diag(jnp.array([1.0, 4.0]))[None]
      >>> q, nu = _refit(s, jnp.eye(2)[None], jnp.array([[10.0, 40.0]]), 0, jnp.array([False]),
      ...                True)
      >>> jnp.abs(q).tolist(), nu.tolist()
      ([[[0.0, 1.0], [1.0, 0.0]]], [[40.0, 10.0]])
      >>> s = jnp.diag(jnp.array([1e-4, 4e-4, 0.0]))[None]  # small, beside a zero row: sorted
      >>> nu = jnp.array([[1.0, 4.0, 0.0]])
      >>> _refit(s, jnp.eye(3)[None], nu, 0, jnp.array([False]), True)[1].tolist()
      [[4.0, 1.0, 0.0]]
  """
  separated = _separated(stats)
  estimated = jnp.einsum("nij,nik,nkj->nj", basis, separated, basis)
  order = jnp.argsort(-estimated, axis=-1, stable=True)
  order = jnp.where(refresh, order, jnp.arange(order.shape[-1]))
  sorted_basis = jnp.take_along_axis(basis, order[:, None, :], axis=2)
  shape = [1] * nu.ndim
  shape[0], shape[1 + dim] = order.shape
  nu = jnp.take_along_axis(nu, order.reshape(shape), axis=1 + dim)
  values = jnp.take_along_axis(estimated, order, axis=-1)

  def one(s, separated, power, values, old, unfit):
    def fit():
      values, vectors = jnp.linalg.eigh(separated)
      return values[::-1], vectors[:, ::-1]

    values, vectors = gating.cond(unfit, fit, lambda: (values, jnp.linalg.qr(power)[0]))
    return jnp.where(unfit | refresh, canonical(s, values, vectors), old)

  inputs = (stats, separated, separated @ sorted_basis, values, basis, unfit)
  return jax.lax.map(lambda a: one(*a), inputs), nu


def _new_bases(packed, bases, nu, unfit, refresh, *, dims, damping):
  """Every rotated dim's bases from :func:`_refit` (:func:`_power_refit` with ``damping``) of
  its statistics (``packed``: :mod:`~bv_sharding.optimizers.symmetric`, unpacked only here, on
  the steps that refit), and ``nu`` permuted with them."""
  stats = [symmetric.unpack(s) for s in packed]
  if damping:
    return [_power_refit(s, q, unfit, refresh, damping) for s, q in zip(stats, bases)], nu
  new_bases = []
  for s, q, dim in zip(stats, bases, dims):
    q, nu = _refit(s, q, nu, dim, unfit, refresh)
    new_bases.append(q)
  return new_bases, nu


def _soap_blocks(g, mu, nu, stats, bases, first, refresh, *, dims, hyper):
  """One block stack's step (module docstring): (Adam's direction in the old bases, rotated
  back; new ``mu``, ``nu``, statistics and bases). :func:`_refit` (a block's ``eigh`` or
  QR, one matrix a call) runs under ``lax.cond`` (where that is safe,
  :mod:`~bv_sharding.optimizers.gating`), only on the steps that need it; the moments
  are carried into the new bases only then."""
  (b1, b2), shampoo_beta, (eps, relative_eps), damping = hyper
  g = g.astype(jnp.float32)
  old_mu, old_nu = mu.astype(jnp.float32), nu.astype(jnp.float32)
  rotated = _rotate(g, bases, dims, back=False)
  mu = b1 * old_mu + (1.0 - b1) * rotated
  nu = b2 * old_nu + (1.0 - b2) * jnp.square(rotated)
  direction = _rotate(mu / (_root_nu(nu, relative_eps) + eps), bases, dims, back=True)
  was_zero = _unfit(stats[0])
  grams = [symmetric.pack(jax.vmap(gram_along, (0, None))(g, d)) for d in dims]
  stats = [s + (1.0 - shampoo_beta) * (gg - s) for s, gg in zip(stats, grams)]
  unfit = was_zero & ~_unfit(stats[0])  # Per block: its first gradient (_unfit_moments).
  refresh, any_unfit = jnp.any(refresh), jnp.any(unfit)
  new_bases, sorted_nu = gating.cond(
      refresh | any_unfit,
      functools.partial(_new_bases, dims=dims, damping=damping),
      lambda _, q, n, *__: (list(q), n),
      stats,
      bases,
      nu,
      unfit,
      refresh,
  )
  unfit = unfit.reshape(unfit.shape + (1,) * (mu.ndim - 1))
  moved = lambda mu: _rotate(_rotate(mu, bases, dims, back=True), new_bases, dims, back=False)
  carried = gating.cond(
      refresh | any_unfit, lambda mu: jnp.where(refresh | unfit, moved(mu), mu), lambda mu: mu, mu
  )
  mu = jnp.where(first, old_mu, carried)
  nu = jnp.where(first, old_nu, jnp.where(unfit, _unfit_moments(carried, b1, b2), sorted_nu))
  return direction, mu, nu, stats, new_bases


def _root_nu(nu: jax.Array, relative_eps: float) -> jax.Array:
  """``sqrt(nu)`` of a block stack ``(n, *tile)``, plus ``relative_eps`` times each block's
  largest: a rotated coordinate whose second moment is far below its tile's strongest moves in
  proportion to its first moment instead of by a whole step of Adam's.

  Example:
      >>> _root_nu(jnp.array([[4.0, 0.0], [1.0, 1.0]]), 0.25).tolist()
      [[2.5, 0.5], [1.25, 1.25]]
  """
  root = jnp.sqrt(nu)
  if not relative_eps:
    return root
  return root + relative_eps * jnp.max(root, axis=tuple(range(1, nu.ndim)), keepdims=True)


def _unfit_moments(mu: jax.Array, b1: float, b2: float) -> jax.Array:
  """The second moment beside ``mu`` when both hold one gradient ``x`` (``(1 - b1) x`` and
  ``(1 - b2) x^2``): a block's moments when its statistics become nonzero this step (its
  first gradient: a fresh or reborn state's first step, or all earlier ones zero), re-expressed
  in the bases just fitted to it (``mu`` rotated, ``nu`` from it).

  Example:
      >>> _unfit_moments(jnp.array([0.5, -1.0]), 0.5, 0.75).tolist()
      [0.25, 1.0]
  """
  return (1.0 - b2) * jnp.square(mu / (1.0 - b1))


def _soap_run(arrays, factors, first, refresh, *, dims, hyper):
  """:func:`_soap_blocks` as :func:`~bv_sharding.optimizers.blocked.run_blocked` calls it."""
  direction, mu, nu, stats, bases = _soap_blocks(
      *arrays, *factors, first, refresh, dims=dims, hyper=hyper
  )
  return [direction, mu, nu], [stats, bases]


def _soap_held(arrays, held: Resident, first, refresh, *, dims, hyper):
  """:func:`_soap_blocks` on a device's slots of a pool whose state is kept where it runs:
  ``([direction], the slots' new state)``, the state in its own dtypes."""
  direction, mu, nu, stats, bases = _soap_blocks(
      arrays[0],
      held["mu"],
      held["nu"],
      held["stats"],
      held["bases"],
      first,
      refresh,
      dims=dims,
      hyper=hyper,
  )
  new = Resident(dict(mu=mu, nu=nu, stats=stats, bases=bases), held.where)
  return [direction], jax.tree.map(lambda x, old: x.astype(old.dtype), new, held)


def _adam(g, mu, nu, first, settings: _Settings):
  """A param no dim of which is rotated: Adam's direction and moments (unchanged on the
  first step)."""
  (b1, b2), eps = settings.betas, settings.eps
  g, old_mu, old_nu = (x.astype(jnp.float32) for x in (g, mu, nu))
  mu = b1 * old_mu + (1.0 - b1) * g
  nu = b2 * old_nu + (1.0 - b2) * jnp.square(g)
  direction = mu / (jnp.sqrt(nu) + eps)
  return direction, jnp.where(first, old_mu, mu), jnp.where(first, old_nu, nu)


def _finish(direction, count, settings: _Settings, scanned: bool = False):
  """The param's step from its direction: normalised (``normalize_grads``; a stack of layers'
  (``scanned``) layer by layer), bias-corrected
  (``correct_bias``: ``sqrt(1 - b2^t) / (1 - b1^t)``), zero on the first step.

  Example:
      >>> s = _Settings((0.5, 0.5), 0.5, 1e-8, 1, 10, False, False, False, True, 4, None, "tiles")
      >>> [round(float(x), 4) for x in _finish(jnp.ones(2), jnp.array(1), s)], _finish(jnp.ones(2), 0, s).tolist()
      ([1.4142, 1.4142], [0.0, 0.0])
  """
  (b1, b2), t = settings.betas, jnp.maximum(count, 1).astype(jnp.float32)
  if settings.normalize_grads:
    axes = tuple(range(1, direction.ndim)) if scanned else None
    rms = jnp.sqrt(jnp.mean(jnp.square(direction), axis=axes, keepdims=scanned))
    direction = direction / (1e-30 + rms)
  if settings.correct_bias:
    direction = direction * jnp.sqrt(1.0 - b2**t) / (1.0 - b1**t)
  return jnp.where(count == 0, 0.0, direction)


def _unfit(stats: jax.Array) -> jax.Array:
  """Per block of a stack of one dim's statistics ``(..., b, b)``: whether it is still zero (no
  gradient yet): its bases are fitted on the step it becomes nonzero.

  Example:
      >>> _unfit(jnp.zeros((2, 3, 3)).at[0].set(1.0)).tolist()
      [False, True]
  """
  return jnp.all(stats == 0, axis=(-2, -1))


def _any_unfit(stats) -> jax.Array:
  """Whether any block of any of these statistics (each param's :class:`Stacks`) is
  :func:`_unfit`.

  Example:
      >>> zero, one = jnp.zeros((2, 3, 3)), jnp.ones((2, 3, 3))
      >>> bool(_any_unfit([[one], [zero.at[0].set(1.0)]])), bool(_any_unfit([[one]]))
      (True, False)
  """
  unfit = [jnp.any(_unfit(s[0])) for s in stats]
  return functools.reduce(jnp.logical_or, unfit, jnp.bool_(False))


def _soap_update(updates, state: SoapState, params=None, *, settings: _Settings):
  """``scale_by_soap``'s update: every param's tiles in one
  :func:`~bv_sharding.optimizers.blocked.run_blocked`. Pools kept where they run do so on a
  concrete mesh; elsewhere (global arrays: an ``AbstractMesh``'s shapes) the step runs on the
  state given back to the params, and their pools are kept again after."""
  del params
  if state.pools and not isinstance(settings.layout.mesh, jax.sharding.Mesh):
    apart = given_back(state, updates, settings.layout)
    updates_out, new = _soap_update(
        updates, apart, settings=dataclasses.replace(settings, resident_padding=0.0)
    )
    return updates_out, held(new, updates, settings.layout, state.pools)
  grads, treedef = jax.tree.flatten(updates)
  per_param = treedef.flatten_up_to(state.per_param)
  plans = _leaf_plans(updates, settings)
  count = state.count
  first = count == 0
  refresh = (count > 0) & (count % settings.precondition_frequency == 0)
  hyper = (
      settings.betas,
      settings.shampoo_beta,
      (settings.eps, settings.relative_eps),
      settings.power_damping,
  )
  pool_of = {seat.leaf: k for k, pool in enumerate(state.pools) for seat in pool.where[1]}
  pool_fns = [  # One function per pool: its runs pool together, as the state's pools.
      functools.partial(_soap_held, dims=pool.where[0], hyper=hyper) for pool in state.pools
  ]
  # The bases change only where they are refreshed or fitted (a block still zero may be fitted
  # this step): a pool moves them back only then.
  new_bases = refresh | _any_unfit(
      s.stats
      for i, (s, (_, dims, _)) in enumerate(zip(per_param, plans))
      if dims and i not in pool_of
  )
  fns: dict[tuple, Any] = {}  # One function per kind of param: like tiles pool together.
  runs = []
  for i, (g, s, (blocks, dims, _)) in enumerate(zip(grads, per_param, plans)):
    if not dims:
      runs.append(None)
      continue
    turnable = dims == (0, 1)  # Both dims rotated: the same work on the transpose.
    if i in pool_of:  # Its pool's state is kept where the pool runs: only the gradient moves.
      k = pool_of[i]
      g = g.astype(jnp.float32).reshape(blocks.shape)
      runs.append(
          BlockRun(
              blocks, pool_fns[k], [g], [], [first, refresh], (), (), turnable, (), state.pools[k]
          )
      )
      continue
    fn = fns.setdefault(dims, functools.partial(_soap_run, dims=dims, hyper=hyper))
    arrays = [x.reshape(blocks.shape) for x in (g, s.mu, s.nu)]
    stacks, flags = [s.stats, s.bases], [first, refresh]
    runs.append(BlockRun(blocks, fn, arrays, stacks, flags, (), [None, new_bases], turnable))
  new_updates, new_per_param, new_pools = [], [], list(state.pools)
  place = param_placers(settings.layout, treedef)
  cast = lambda x, like: x.reshape(like.shape).astype(like.dtype)
  for i, (g, s, result, put, (_, _, tiling)) in enumerate(
      zip(grads, per_param, blocked.run_blocked(runs), place, plans)
  ):
    if i in pool_of:
      (direction,), new_pools[pool_of[i]] = result
      new_per_param.append(s)
    else:
      stats, bases = s.stats, s.bases
      if result is None:
        direction, mu, nu = _adam(g, s.mu, s.nu, first, settings)
      else:
        (direction, mu, nu), (stats, bases) = result
      new_per_param.append(SoapParamState(stats, bases, put(cast(mu, s.mu)), put(cast(nu, s.nu))))
    new_updates.append(put(cast(_finish(direction, count, settings, tiling.scanned), g)))
  return treedef.unflatten(new_updates), SoapState(
      optax.safe_increment(count), treedef.unflatten(new_per_param), tuple(new_pools)
  )


def scale_by_soap(
    betas: tuple[float, float] = (0.95, 0.95),
    shampoo_beta: float = -1,
    eps: float = 1e-8,
    precondition_frequency: int = 10,
    max_precond_dim: int = 10000,
    merge_dims: bool = False,
    precondition_1d: bool = False,
    normalize_grads: bool = False,
    correct_bias: bool = True,
    block_size: int = 1024,
    layout: ParamLayout | None = None,
    blocking: str = "tiles",
    resident_padding: float = 0.0,
    power_damping: float = 1e-2,
    relative_eps: float = 0.0,
) -> optax.GradientTransformation:
  """SOAP's direction (no learning rate); arguments as the reference's ``SOAP``.

  Args:
    betas: Adam's ``(b1, b2)``, run in the rotated basis.
    shampoo_beta: the statistics' EMA decay; negative: ``betas[1]``.
    eps: Adam's epsilon (added to ``sqrt(nu)``).
    precondition_frequency: the bases are refreshed (power iteration and QR) every this
      many steps.
    max_precond_dim: dims larger than this are not rotated.
    merge_dims: merge neighbouring dims while their product is within ``max_precond_dim``.
    precondition_1d: rotate 1-D params too (else they train with Adam).
    normalize_grads: scale each param's direction to RMS 1.
    correct_bias: Adam's bias correction ``sqrt(1 - b2^t) / (1 - b1^t)``.
    block_size: tiles of at most this size per dim (Shampoo's,
      :func:`~bv_sharding.optimizers.shampoo.factor_tiling`); each tile has its own
      statistics and bases.
    layout: the params' specs and mesh (:class:`ParamLayout`): tiles are run where they live.
    blocking: "tiles" (the same tiles on any mesh) or "local" (each shard's own blocks).
    resident_padding: a pool of tiles (tiles that span their param's shards, each fitted
      whole by one device: :mod:`~bv_sharding.optimizers.pools`) whose slots (its tiles
      padded to a multiple of the device count) are at most this many times its tiles keeps
      its state on the devices that run it (:mod:`~bv_sharding.optimizers.holding`: one
      :class:`~bv_sharding.optimizers.pools.Resident` per pool in ``SoapState.pools``)
      instead of each param's moments and factors stored spread over the mesh and moved to
      the pool and back every step. The step then moves only the gradient's and the
      direction's pieces; the state takes the pool's padding and its shapes depend on the
      mesh (:func:`~bv_sharding.optimizers.portable.canonical_state` gives it in the form
      that does not). 1.5: 8 devices' pools of lm small (12 and 18 tiles in 16 and 24 slots)
      are kept, and the step moves 1.11x adamw's bytes instead of 1.82x. 0 (the default, a
      state any mesh resumes): no pool is kept. Use 1.5 where checkpoints store the state
      given back (:func:`~bv_sharding.optimizers.portable.canonical_state`).
    power_damping: above 0, bases that move continuously with the statistics, so that float
      rounding (a gradient summed in another order, on another mesh) moves them by about as
      much instead of choosing among nearly equal eigenvalues' eigenvectors: fitted by
      :data:`FIT_ITERATIONS` power iterations from ``I`` and refreshed by one, on the
      statistics plus this fraction of their largest diagonal entry (:func:`_power_refit`),
      their columns never re-sorted. 1e-2 keeps a small language model's losses within 1.4e-4
      of one device's over 30 steps on 2 to 8 devices (3.6e-4 at another seed; the
      reference's bases: 0.04-0.11), its eval loss 0.005 ± 0.009 from theirs; with
      ``relative_eps=1e-3`` within 1e-4 for every seed tried, at 0.023 ± 0.009 of eval loss.
      0: the reference's bases (``eigh``, then sorted QR refreshes).
    relative_eps: added to Adam's ``sqrt(nu)`` in a rotated block, as a fraction of the
      block's largest (:func:`_root_nu`), beside ``eps``: a coordinate whose gradient is far
      below the block's strongest, where a basis off by float rounding puts most of its
      value, moves in proportion rather than by a whole step.

  Example:
      >>> tx = scale_by_soap(block_size=2)
      >>> state = tx.init({"w": jnp.ones((4, 2))})
      >>> state.per_param["w"].bases[0].shape  # a 2 x 1 grid of 2 x 2 bases
      (2, 1, 2, 2)
  """
  if shampoo_beta < 0:
    shampoo_beta = betas[1]
  settings = _Settings(
      tuple(betas),
      shampoo_beta,
      eps,
      precondition_frequency,
      max_precond_dim,
      merge_dims,
      precondition_1d,
      normalize_grads,
      correct_bias,
      block_size,
      layout,
      blocking,
      resident_padding,
      power_damping,
      relative_eps,
  )
  if len(settings.betas) != 2 or not all(0 <= b < 1 for b in (*settings.betas, shampoo_beta)):
    raise OptimizerError(f"betas={betas!r}, shampoo_beta={shampoo_beta!r}: decays in [0, 1)")
  if resident_padding and resident_padding < 1:
    raise OptimizerError(f"resident_padding={resident_padding!r}: 0 (none), or at least 1")
  for name, value in ("power_damping", power_damping), ("relative_eps", relative_eps):
    if not 0 <= value < 1:
      raise OptimizerError(f"{name}={value!r}: a fraction in [0, 1)")
  if block_size < 1 or precondition_frequency < 1 or max_precond_dim < 1:
    raise OptimizerError("block_size, precondition_frequency and max_precond_dim must be >= 1")
  return blocked.transformation(_soap_init, _soap_update, settings)


def decay_after_step(learning_rate: optax.ScalarOrSchedule, weight_decay: float):
  """The reference's decoupled weight decay, applied after the step: ``p <- (p + u)(1 - lr
  wd)`` for the update ``u`` it follows; none on the first step (SOAP's, which moves
  nothing). Its count is a schedule's (``optax.ScaleByScheduleState``): in a state born
  mid-run it continues at the global step, and the first step decays.

  Example:
      >>> tx = decay_after_step(0.5, 0.1)
      >>> p = {"w": jnp.ones(2)}
      >>> state = tx.update(p, tx.init(p), p)[1]  # The first step: no decay.
      >>> [round(float(u), 4) for u in tx.update(p, state, p)[0]["w"]]  # (1 + 1)(1 - 0.05) - 1
      [0.9, 0.9]
  """

  def update(updates, state, params):
    if params is None:
      raise OptimizerError("SOAP's weight decay needs the params: update(updates, state, params)")
    lr = learning_rate(state.count) if callable(learning_rate) else learning_rate
    rate = jnp.where(state.count == 0, 0.0, lr * weight_decay)
    decayed = jax.tree.map(lambda u, p: (u - rate * (p + u)).astype(u.dtype), updates, params)
    return decayed, optax.ScaleByScheduleState(optax.safe_increment(state.count))

  init = lambda _: optax.ScaleByScheduleState(jnp.zeros([], jnp.int32))
  return optax.GradientTransformation(init, update)


def soap(
    learning_rate: optax.ScalarOrSchedule = 3e-3,
    betas: tuple[float, float] = (0.95, 0.95),
    shampoo_beta: float = -1,
    eps: float = 1e-8,
    weight_decay: float = 0.01,
    precondition_frequency: int = 10,
    max_precond_dim: int = 10000,
    merge_dims: bool = False,
    precondition_1d: bool = False,
    normalize_grads: bool = False,
    correct_bias: bool = True,
    mask: Any | None = None,
    block_size: int = 1024,
    layout: ParamLayout | None = None,
    blocking: str = "tiles",
    resident_padding: float = 0.0,
    power_damping: float = 1e-2,
    relative_eps: float = 0.0,
) -> optax.GradientTransformation:
  """SOAP with the learning rate and the reference's weight decay (:func:`decay_after_step`;
  ``mask``: which params get it). The other arguments are :func:`scale_by_soap`'s.

  Example:
      >>> opt = soap(3e-3, block_size=128)
      >>> params = {"w": jnp.ones((4, 4))}
      >>> updates, _ = opt.update(params, opt.init(params), params)
  """
  tx = scale_by_soap(
      betas=betas,
      shampoo_beta=shampoo_beta,
      eps=eps,
      precondition_frequency=precondition_frequency,
      max_precond_dim=max_precond_dim,
      merge_dims=merge_dims,
      precondition_1d=precondition_1d,
      normalize_grads=normalize_grads,
      correct_bias=correct_bias,
      block_size=block_size,
      layout=layout,
      blocking=blocking,
      resident_padding=resident_padding,
      power_damping=power_damping,
      relative_eps=relative_eps,
  )
  decay = decay_after_step(learning_rate, weight_decay) if weight_decay else None
  if decay is not None and mask is not None:
    decay = optax.masked(decay, mask)
  parts = [tx, optax.scale_by_learning_rate(learning_rate), decay]
  return optax.chain(*[p for p in parts if p is not None])
