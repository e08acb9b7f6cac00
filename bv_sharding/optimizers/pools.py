"""Pooled tiles: tiles of several params, one stack dealt over the whole mesh.

Where a param's ``block_size`` tiles span several shards and no holder can own whole ones
(fewer tiles than holders, or tiles not aligned with the shards), its blocks are
:attr:`~bv_sharding.optimizers.tiles.ShardBlocks.pooled`: the param's global tile grid. The
runs of pooled params that share ``fn``, the tile shape and their stacks' structure, shapes and
dtypes (:func:`pool_key`) form one pool: :func:`run_pool` concatenates their block stacks
(arrays and factor stacks), pads them to a multiple of the device count (:func:`padded`) and
splits them over every mesh axis, so each device fits and applies its ``1/N`` of all those
tiles, in one ``shard_map`` (a device holding padding alone skips the work:
:func:`unless_padding`). Every reshard on the way moves one run of mesh axes at a time
(:func:`~bv_sharding.optimizers.moves.move`). Each array is first resharded to its param's
tile layout (:func:`_tile_spec`) and seen as each device's pieces of its tiles
(:mod:`~bv_sharding.optimizers.pieces`), and each stored stack is kept spread at the ideal
(:func:`~bv_sharding.optimizers.placement.stored_spec`), so that all of them move to the pool,
and back, in one all-to-all each way, of about their shards' bytes. A pool may instead keep
its runs' state where it runs them (:class:`Resident`,
:attr:`~bv_sharding.optimizers.shard_run.BlockRun.resident`; which pools:
:mod:`~bv_sharding.optimizers.holding`): then only the arrays move.

Example:
    >>> from bv_sharding.optimizers.tiles import shard_blocks
    >>> mesh = jax.sharding.AbstractMesh((2, 2), ("data", "model"))
    >>> shard_blocks((8, 6), P("data", "model"), mesh, 4).pooled  # 3 of a 4-tile's 6 columns
    True
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from bv_sharding import ops
from bv_sharding.ops import stack_axes
from bv_sharding.optimizers import draws, moves, opaque
from bv_sharding.optimizers.gating import gated
from bv_sharding.optimizers.pieces import Layout, from_pieces, to_pieces
from bv_sharding.optimizers.placement import spread, stored
from bv_sharding.optimizers.shard_run import BlockRun
from bv_sharding.optimizers.tiles import ShardBlocks, spec_entry


def _stacks_key(blocks: ShardBlocks, stacks) -> tuple:
  """What a pool's members share: tile shape, devices, stacks' structure and each stack's
  shape past its grid (a pool of mixed dtypes joins in the widest)."""
  grid = len(blocks.grid_shape)
  return (
      blocks.sizes,
      blocks.devices,
      jax.tree.structure(stacks),
      tuple(tuple(x.shape[grid:]) for x in jax.tree.leaves(stacks)),
  )


class Resident(dict):
  """A pool's state kept where the pool runs it (:attr:`~bv_sharding.optimizers.shard_run.\
BlockRun.resident`): named arrays (or lists of them), each ``(slots, ...)``, one slot per tile
  in the pool's order (:func:`slot_count` of them, the last ones padding), split over every mesh
  axis on dim 0, so that each device holds its own slots' state and the step moves none of it.
  ``where``: static, what its optimizer needs to read each param's tiles back from it. A
  pytree node whose placement is declared to the plan (``per_param=False``), wherever it sits
  in a state.

  Example:
      >>> import bv_sharding as bvs
      >>> mesh = bvs.make_abstract_mesh([("data", 2), ("model", 2)], 4)
      >>> pool = Resident({"mu": jax.ShapeDtypeStruct((8, 4, 4), "float32")})
      >>> tree = {"params": {"w": jax.ShapeDtypeStruct((4, 4), "float32")}, "opt": [pool]}
      >>> entry = bvs.plan(tree, "replicate()", mesh).by_name()["opt/0/mu"]
      >>> entry.spec, entry.why
      (P(('data', 'model'), None, None), 'declared by Resident')
  """

  where: Any

  def __init__(self, arrays=(), where: Any = None):
    super().__init__(arrays)
    self.where = where


jax.tree_util.register_pytree_with_keys(
    Resident,
    lambda r: ([(jax.tree_util.DictKey(k), r[k]) for k in sorted(r)], (tuple(sorted(r)), r.where)),
    lambda aux, children: Resident(zip(aux[0], children), aux[1]),
    lambda r: ([r[k] for k in sorted(r)], (tuple(sorted(r)), r.where)),
)


def _held_specs(node: Resident, sizes: dict[str, int]) -> list:
  """Every leaf of ``node`` split over every mesh axis (in mesh order) on its dim 0."""
  return [P(spec_entry(stack_axes((), sizes))) for _ in jax.tree.leaves(node)]


ops.register_state(Resident, _held_specs, per_param=False)


def slot_count(tiles: int, devices: int) -> int:
  """How many slots a pool of ``tiles`` tiles takes on ``devices`` devices: the tiles padded to
  a multiple of the device count.

  Example:
      >>> slot_count(12, 8), slot_count(16, 8)
      (16, 16)
  """
  return tiles + -tiles % devices


def padded(stack: jax.Array, length: int) -> jax.Array:
  """``stack`` padded to ``length`` along dim 0 with copies of its last block.

  Example:
      >>> padded(jnp.arange(2.0), 4).tolist()
      [0.0, 1.0, 1.0, 1.0]
  """
  return jnp.concatenate([stack, jnp.repeat(stack[-1:], length - stack.shape[0], axis=0)])


def unless_padding(run, start, count: int, real: int, always: bool = False) -> Any:
  """``run()`` on a device whose ``count`` slots of a pool start at slot ``start``, unless
  they are all padding (none in ``0 .. real - 1``): zeros of its shapes there, which are
  dropped anyway (``always``: every slot is a tile). A pool of fewer tiles than devices then
  runs its tiles once, not once per device. The work holds no collective, so devices may
  take different branches. On one host of simulated devices, where every device's work
  shares the same cores, this halved Kron's and Shampoo's update of a one-layer Llama's
  params on 8 devices (338 -> 179 ms and 353 -> 172 ms).

  Example:
      >>> unless_padding(lambda: jnp.ones(2), jnp.array(4), 2, 3).tolist()
      [0.0, 0.0]
      >>> unless_padding(lambda: jnp.ones(2), jnp.array(-1), 2, 3).tolist()  # slot 0 is a tile
      [1.0, 1.0]
  """
  if always:
    return run()
  skipped = lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(run))
  return jax.lax.cond((start < real) & (start + count > 0), run, skipped)


def shared_flags(runs: Sequence[BlockRun], field: str, count: int) -> list:
  """Each of ``count`` entries of the runs' ``field`` (``read_when`` or ``write_when``): the
  flag every run gives as the same object, else None (every step).

  Example:
      >>> flag = jnp.bool_(True)
      >>> runs = [BlockRun(None, None, [], (), read_when=[flag, None]), BlockRun(None, None, [], ())]
      >>> shared_flags(runs[:1], "read_when", 2), shared_flags(runs, "read_when", 2)
      ([Array(True, dtype=bool), None], [None, None])
  """
  given = [list(getattr(run, field)) + [None] * (count - len(getattr(run, field))) for run in runs]
  return [
      None if any(g[k] is not given[0][k] for g in given) else given[0][k] for k in range(count)
  ]


def pool_key(run: BlockRun) -> tuple:
  """What runs share to join one pool: ``fn`` (the same object), the mesh, the dtypes and
  :func:`_stacks_key`."""
  dtypes = tuple(x.dtype for x in [*run.arrays, *jax.tree.leaves(run.stacks)])
  return (run.fn, run.blocks.mesh, dtypes, id(run.resident)) + _stacks_key(run.blocks, run.stacks)


def like_groups(runs: Sequence[BlockRun]) -> list[list[int]]:
  """The indices of ``runs`` grouped by their blocks (the same param shape, spec and tiles),
  in order of first appearance: each group's arrays and stacks move to the pool as one.

  Example:
      >>> from bv_sharding.optimizers.tiles import ShardBlocks
      >>> a, b = ShardBlocks((4, 4), (1, 1), 2), ShardBlocks((4, 2), (1, 1), 2)
      >>> like_groups([BlockRun(a, None, [], ()), BlockRun(b, None, [], ()), BlockRun(a, None, [], ())])
      [[0, 2], [1]]
  """
  groups: dict[ShardBlocks, list[int]] = {}
  for i, run in enumerate(runs):
    groups.setdefault(run.blocks, []).append(i)
  return list(groups.values())


def run_pool(runs: Sequence[BlockRun]):
  """``(outs per run, new stacks per run)``: ``fn`` once on the runs' blocks, in ``shard_map``
  over the pool's dim 0 split over every mesh axis (each device its ``1/N`` of the tiles).

  Each run's arrays are cut into tiles on their :func:`_tile_spec` (most often their param's
  own spec) and the tiles, split however that leaves them, seen as each device's pieces
  (:func:`~bv_sharding.optimizers.pieces.to_pieces`, local), so that tiles split on their rows
  and on their columns join one array, whose move to dim 0 (and back) is one all-to-all; in
  the ``shard_map`` each slot's tile is read back from its pieces by its own layout. The
  stacks are stored spread over the mesh axes along a block dim of their own
  (:func:`~bv_sharding.optimizers.placement.stored_spec`: a 3-D or 4-D param's factor stacks,
  ``(n, b, b)`` and ``(n, b)``, differ in rank), and are seen as pieces too: what moves each
  way under one flag (below) and in one dtype moves as one array, the pieces side by side
  (:func:`_bundles`), so a pool takes one all-to-all each way however many arrays and factors
  it moves (XLA:CPU compiles each all-to-all of a new shape as a kernel per device). Runs of
  like params (:func:`like_groups`) are stacked first and move as one array (a leading dim no
  mesh axis splits): the program holds one move per group of like params, not one per param, and the
  bytes are the same; each reads its results from the group's at an index XLA cannot see
  (:mod:`~bv_sharding.optimizers.opaque`), so their kernels are one. ``stacks`` is a
  sequence, each entry a tree of stacks. An array the runs read only when a flag holds, and an
  entry of stacks they change only then (the same flag object in every run's ``read_when`` or
  ``write_when``), moves in or back only when the flag holds
  (:func:`~bv_sharding.optimizers.gating.gated`: on accelerators; on XLA:CPU it moves every
  step and the flag picks, the same values: :mod:`~bv_sharding.optimizers.gating`). A run's
  :attr:`~bv_sharding.optimizers.shard_run.BlockRun.squares` follow its outs: each slot's sum of
  squares is taken once, on the out pieces moved back (one kernel for the pool), and each
  param's is the sum over its slots.
  """
  return run_pools([runs])[0]


def run_pools(pools: Sequence[Sequence[BlockRun]]) -> list:
  """Each pool's :func:`run_pool` result, a pool riding in another's slots where it fits.

  A pool pads its tiles to a multiple of the device count, and its padding slots move like
  the others. A pool that moves everything every step and draws nothing in place
  (:attr:`_Pool.free`) rides in such a pool where its tiles' pieces fit, several side by side
  in a slot (:meth:`_Pool.seats`): in the host's padding slots, or, where those are too few,
  in slots the host adds at the end of every device's share (so that each device runs a few
  of the rider's tiles, as it would in the rider's own pool). Its tiles move in and back
  inside the host's all-to-alls and the devices that hold those slots run them in the host's
  ``shard_map``: it takes no all-to-all of its own. (Shampoo on a small Llama over 8 devices:
  its 5 norm scales' tiles of 128 ride in one padding slot of its pool of 14 tiles of
  128 x 256; on a medium one, its 34 tiles of the scales ride in 2 slots added to each
  device's 53.)

  Example:
      >>> run_pools([])
      []
  """
  prepared = [_Pool(runs) for runs in pools]
  hosts = _hosts(prepared)
  results: list = [None] * len(prepared)
  for h, pool in enumerate(prepared):
    if h in hosts:
      continue
    riders = [(r, seats) for r, (host, seats) in hosts.items() if host == h]
    rider, seats = (prepared[riders[0][0]], riders[0][1]) if riders else (None, Seats(0, 0))
    for i, result in zip([h, *(r for r, _ in riders)], _run(pool, rider, seats)):
      results[i] = result
  return results


class Seats(NamedTuple):
  """Where a rider's tiles ride: ``per`` side by side in each slot, in the host's padding
  slots (``extra`` 0) or in ``extra`` slots added to every device's share."""

  per: int
  extra: int


def _hosts(pools: Sequence[_Pool]) -> dict[int, tuple[int, Seats]]:
  """Each rider's host and its :class:`Seats` (:meth:`_Pool.seats`), by index: each
  :attr:`~_Pool.free` pool, smallest first, rides in the first other free pool that neither
  rides nor carries one yet and seats it."""
  hosts: dict[int, tuple[int, Seats]] = {}
  free = sorted((i for i, pool in enumerate(pools) if pool.free), key=lambda i: pools[i].moved)
  for r in free:
    taken = set(hosts) | {host for host, _ in hosts.values()}
    if r in taken:
      continue
    for h in (h for h in free if h != r and h not in taken):
      seats = pools[h].seats(pools[r])
      if seats.per:
        hosts[r] = (h, seats)
        break
  return hosts


class _Pool:
  """A pool's runs, ready to run (:func:`_run`): what moves in as pieces (:meth:`pieces_in`),
  each device's work on its slots (:meth:`inner`) and the way back (:meth:`finish`)."""

  def __init__(self, runs: Sequence[BlockRun]):
    self.runs = runs
    self.mesh = mesh = runs[0].blocks.mesh
    sizes = dict(mesh.shape)
    self.axes = axes = stack_axes((), sizes)
    self.dealt = P(spec_entry(axes))
    self.spread_pieces = (None, spec_entry(axes), None)  # Each device its piece of every tile.
    self.dealt_pieces = (spec_entry(axes), None, None)  # Each device its slots' tiles, whole.
    self.groups = groups = like_groups(runs)
    self.ordered = ordered = [runs[i] for members in groups for i in members]  # Its order.
    counts = [run.blocks.count for run in ordered]
    self.real = sum(counts)
    self.total = slot_count(self.real, mesh.size)
    self.tile_specs = [(None, *_tile_spec(runs[m[0]].blocks, sizes)) for m in groups]
    self.layouts = [
        _layout(runs[m[0]].blocks, spec, axes) for m, spec in zip(groups, self.tile_specs)
    ]
    self.kinds = list(dict.fromkeys(self.layouts))  # Distinct layouts, each slot's one of them.
    self.param_specs = [_param_spec(runs[m[0]].blocks) for m in groups]
    self.width = max(layout.width for layout in self.kinds)
    self.cuts, factors = [], []
    for members, tile_spec, layout, param_spec in zip(
        groups, self.tile_specs, self.layouts, self.param_specs
    ):
      blocks, like = runs[members[0]].blocks, [runs[i] for i in members]
      # Each array resharded to its params' tile layout, cut into their tiles, seen as pieces.
      cut = lambda xs, blocks=blocks, src=param_spec, dst=tile_spec, layout=layout: self.place(
          to_pieces(
              self.place(
                  _flat(jax.vmap(blocks.split)(self.move(_stack(*xs), src, dst))),
                  P(None, *layout.entries),
              ),
              layout,
              self.width,
          ),
          P(*self.spread_pieces),
      )
      self.cuts.append(lambda j, like=like, cut=cut: cut([r.arrays[j] for r in like]))
      grouped = jax.tree.map(_stack, *[r.stacks for r in like])
      factors.append(
          jax.tree.map(lambda x, blocks=blocks: _flat(jax.vmap(blocks.to_run)(x)), grouped)
      )
    kind = [self.kinds.index(layout) for m, layout in zip(groups, self.layouts) for _ in m]
    self.slot_kinds = np.array([k for k, n in zip(kind, counts) for _ in range(n)])

    self.drawn = drawn_in_place(runs)
    self.resident = runs[0].resident  # The pool's state kept where it runs, or None.
    self.read_when = shared_flags(runs, "read_when", len(runs[0].arrays))
    self.write_when = shared_flags(runs, "write_when", len(runs[0].stacks))
    # The pool's stacks: per entry, a tree whose every leaf is one stack, split along a block dim.
    self.entries = jax.tree.map(
        lambda *parts: jnp.concatenate([self.along(x) for x in parts]), *factors
    )
    self.leaves = [jax.tree.leaves(entry) for entry in self.entries]
    self.stack_layouts = [
        [_stack_layout(x.shape[1:], axes, sizes) for x in xs] for xs in self.leaves
    ]
    # What moves in, as pieces: each array not drawn in place, and each stack.
    self.ins = [
        _Part(self.read_when[j], runs[0].arrays[j].dtype, self.width, ("array", j), None)
        for j in range(len(self.read_when))
        if j not in self.drawn
    ] + [
        _Part(None, x.dtype, layout.width, ("stack", k, i), layout)
        for k, (xs, layouts_k) in enumerate(zip(self.leaves, self.stack_layouts))
        for i, (x, layout) in enumerate(zip(xs, layouts_k))
    ]
    self.bundles_in = _bundles(self.ins)
    self.shared, self.per_block = [], []
    for values in zip(*[r.scalars for r in ordered]):
      same = all(v is values[0] for v in values)
      self.shared.append(values[0] if same else None)
      self.per_block.append(
          None
          if same
          else jnp.concatenate([jnp.broadcast_to(v, (n,)) for v, n in zip(values, counts)])
      )
    self.outs_spec: list[_Part] = []  # What moves out, as the body makes it (:meth:`inner`).

  def place(self, x: jax.Array, spec: P) -> jax.Array:
    return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))

  def hold(self, x: jax.Array) -> jax.Array:
    """A leaf of the pool's resident state, split over every mesh axis on its slots."""
    return self.place(x, P(*self.dealt, *(None,) * (x.ndim - 1)))

  def move(self, x: jax.Array, src, dst) -> jax.Array:
    return moves.move(x, self.mesh, src, dst)

  def along(self, x: jax.Array) -> jax.Array:
    """A stack (tiles or factors, of any rank) split along a block dim, never its dim 0."""
    sizes = dict(self.mesh.shape)
    return self.place(x, P(None, *spread(x.shape[1:], self.axes, sizes)))

  @property
  def free(self) -> bool:
    """Whether everything moves in and back every step and nothing is drawn in place: such a
    pool may carry a rider, or ride (:meth:`seats`)."""
    flags = [*self.read_when, *self.write_when]
    return not self.drawn and self.resident is None and all(f is None for f in flags)

  @property
  def moved(self) -> int:
    """Elements this pool moves in per device piece, over all its slots."""
    return self.total * sum(part.width for part in self.ins)

  def out_parts(self) -> list[_Part]:
    """What :meth:`inner` moves out, found once by tracing it on one slot (no work done)."""
    if not self.outs_spec:
      n = self.mesh.size
      one = [
          jax.ShapeDtypeStruct((1, n, sum(self.ins[i].width for i in m)), self.ins[m[0]].dtype)
          for m in self.bundles_in
      ]
      held = jax.tree.map(lambda x: jax.ShapeDtypeStruct((1, *x.shape[1:]), x.dtype), self.resident)
      jax.eval_shape(
          lambda b, held: self.inner(b, {}, self.per_block, 0, 1, (0, self.total), held),
          one,
          held,
      )
    return self.outs_spec

  def seats(self, rider: _Pool) -> Seats:
    """Where ``rider``'s tiles ride in this pool (:class:`Seats`; ``per`` 0: they cannot):
    both pools free, on one mesh, each of the rider's bundles (in and out) beside one of this
    pool's of its dtype, ``per`` tiles side by side in a slot; all in the padding slots if
    they fit there, else in slots added to every device's share where those move at most
    twice the elements the rider's own pool would (a few more bytes for one all-to-all less
    each way).

    Example:
        >>> from bv_sharding.optimizers.tiles import ShardBlocks
        >>> mesh = jax.make_mesh((4,), ("data",), (jax.sharding.AxisType.Auto,))
        >>> same = lambda tiles, stacks: (tiles, stacks)
        >>> run = lambda size: BlockRun(
        ...     ShardBlocks((size,), (1,), size, spec=(None,), pooled=True, mesh=mesh),
        ...     same, [jnp.ones(size)], ()
        ... )
        >>> _Pool([run(16)]).seats(_Pool([run(4)]))  # 3 padding slots; pieces 4 and 1 wide
        Seats(per=4, extra=0)
        >>> host = _Pool([run(16) for _ in range(4)])  # 4 tiles on 4 devices: no padding
        >>> host.seats(_Pool([run(4) for _ in range(6)]))  # a slot more on each device
        Seats(per=4, extra=1)
    """
    none = Seats(0, 0)
    if rider is self or rider.mesh != self.mesh or not (self.free and rider.free):
      return none
    per, host_width, rider_width = [], 0, 0
    for mine, theirs in (
        (_widths(self.ins), _widths(rider.ins)),
        (_widths(self.out_parts()), _widths(rider.out_parts())),
    ):
      if not set(theirs) <= set(mine):
        return none
      per += [mine[dtype] // width for dtype, width in theirs.items()]
      host_width += sum(mine[dtype] for dtype in theirs)
      rider_width += sum(theirs.values())
    fits = min(per, default=0)
    if not fits:
      return none
    if (self.total - self.real) * fits >= rider.real:
      return Seats(fits, 0)
    n = self.mesh.size
    extra = -(-rider.real // (fits * n))
    return Seats(fits, extra) if n * extra * host_width <= 2 * rider.total * rider_width else none

  def pieces_in(self, bundle: int) -> jax.Array:
    """Bundle ``bundle`` of what moves in: its parts' pieces side by side, ``(real, N, w)``."""

    def pieces(part: _Part) -> jax.Array:
      if part.name[0] == "array":
        return jnp.concatenate([cut(part.name[1]) for cut in self.cuts])
      return to_pieces(self.leaves[part.name[1]][part.name[2]], part.layout)

    return jnp.concatenate([pieces(self.ins[i]) for i in self.bundles_in[bundle]], axis=-1)

  def drawing(self, j: int, tables: tuple) -> Callable[[], jax.Array]:
    """A function that draws the tiles of probe ``j`` from a device's rows of its tables
    (:func:`~bv_sharding.optimizers.draws.pooled_tables`): ``fn`` calls it where it reads the
    probe, so a step that does not (Kron's between its fits) draws nothing."""
    like = draws.pooled_like([(r.arrays[j], r.blocks) for r in self.ordered])
    return functools.partial(draws.from_tables, tables, *like)

  def inner(self, bundles, probes, per_block, start, count, span, held=None) -> tuple:
    """One device's work on its ``count`` slots, the first at ``start`` in the pool's order
    (``span``: the least start and the most end any device has; past the tiles is padding),
    from its in-bundles' pieces to its out-bundles'; with its slots of the pool's resident
    state (``held``), that state's new slots too (else None)."""
    low, high = span
    mine = lambda v: jax.lax.dynamic_slice_in_dim(
        jnp.pad(v, (-low, high - v.shape[0])), start - low, count
    )
    scalars = [s if v is None else mine(v) for s, v in zip(self.shared, per_block)]
    kinds = mine(jnp.asarray(self.slot_kinds))
    chosen = lambda options: _chosen(kinds, options)
    got = _unbundled(self.ins, self.bundles_in, bundles)
    tiles = [
        self.drawing(j, probes[j])
        if j in self.drawn
        else chosen([from_pieces(got[("array", j)], layout) for layout in self.kinds])
        for j in range(len(self.read_when))
    ]
    stacks = [
        jax.tree.unflatten(
            jax.tree.structure(entry),
            [from_pieces(got[("stack", k, i)], layout) for i, layout in enumerate(layouts_k)],
        )
        for k, (entry, layouts_k) in enumerate(zip(self.entries, self.stack_layouts))
    ]
    work = lambda: self.runs[0].fn(tiles, stacks if held is None else held, *scalars)
    outs, new = unless_padding(work, start, count, self.real, low >= 0 and high <= self.real)
    kept, new = (None, new) if held is None else (new, ())
    made = [chosen([to_pieces(o, layout, self.width) for layout in self.kinds]) for o in outs]
    self.outs_spec[:] = [
        _Part(None, o.dtype, self.width, ("out", j), None) for j, o in enumerate(made)
    ]
    for k, entry in enumerate(new):
      for i, (x, layout) in enumerate(zip(jax.tree.leaves(entry), self.stack_layouts[k])):
        made.append(to_pieces(x, layout))
        part = _Part(self.write_when[k], x.dtype, layout.width, ("stack", k, i), layout)
        self.outs_spec.append(part)
    return [jnp.concatenate([made[i] for i in m], axis=-1) for m in _bundles(self.outs_spec)], kept

  def finish(self, parts_for) -> tuple[list, list]:
    """``(outs per run, new stacks per run)`` from the out-pieces moved back: ``parts_for(flag)``
    gives, by name, those that move back under ``flag`` (None: every step)."""
    runs, groups = self.runs, self.groups
    always = parts_for(None)
    outs = [always[("out", j)] for j in range(sum(p.name[0] == "out" for p in self.outs_spec))]
    index = opaque.indices(max(map(len, groups)), self.mesh)
    per_slot = {  # Each slot's sum of squares of an out some run wants it of.
        j: jnp.sum(jnp.square(outs[j].astype(jnp.float32)), axis=(1, 2))
        for j in sorted({j for run in runs for j in run.squares})
    }
    merged, slots, start = [None] * len(runs), [], 0
    for members, tile_spec, layout, param_spec in zip(
        groups, self.tile_specs, self.layouts, self.param_specs
    ):
      blocks, k = runs[members[0]].blocks, len(members)
      n = blocks.count
      mine = lambda x, start=start, k=k, n=n: x[start : start + k * n].reshape(k, n, *x.shape[1:])
      tiles = lambda o, start=start, k=k, n=n, layout=layout: self.place(
          from_pieces(o[start : start + k * n], layout), P(None, *layout.entries)
      ).reshape(k, n, *layout.tile)
      back = [self.move(jax.vmap(blocks.merge)(tiles(o)), tile_spec, param_spec) for o in outs]
      sums = {j: x[start : start + k * n].reshape(k, n).sum(1) for j, x in per_slot.items()}
      for j, i in enumerate(members):
        merged[i] = [opaque.member(x, index[j]) for x in back]
        merged[i] += [opaque.member(sums[o], index[j]) for o in runs[i].squares]
      slots.append((members, blocks, mine))
      start += k * n

    def stacks_back(k, parts: dict):  # Entry k of the pool's new stacks, back to each run's.
      new = jax.tree.unflatten(
          jax.tree.structure(self.entries[k]),
          [
              self.along(from_pieces(parts[("stack", k, i)], layout))
              for i, layout in enumerate(self.stack_layouts[k])
          ],
      )
      out = [None] * len(runs)
      for members, blocks, mine in slots:
        unrun = jax.tree.map(
            lambda x, blocks=blocks, mine=mine: jax.vmap(blocks.from_run)(mine(x)), new
        )
        for j, i in enumerate(members):
          out[i] = stored(blocks, jax.tree.map(lambda x, j=j: opaque.member(x, index[j]), unrun))
      return out

    old_stacks = lambda k: [stored(r.blocks, r.stacks[k]) for r in runs]
    back = [None] * len(self.write_when)
    for flag in {id(f): f for f in self.write_when}.values():
      ks = [k for k, f in enumerate(self.write_when) if f is flag]
      results = gated(
          flag,
          lambda ks=ks, flag=flag: [stacks_back(k, parts_for(flag)) for k in ks],
          lambda ks=ks: [old_stacks(k) for k in ks],
      )
      for k, result in zip(ks, results):
        back[k] = result
    return merged, [list(per_run) for per_run in zip(*back)] if back else [[] for _ in runs]


def _run(pool: _Pool, rider: _Pool | None, seats: Seats) -> list[tuple[list, list]]:
  """``pool``'s result (and ``rider``'s after it): the pool's pieces, padded (the rider's
  seated in its slots, :class:`Seats`), moved to the devices that run them in one all-to-all
  per bundle, both pools' work in one ``shard_map``, and their out-pieces moved back alike."""
  mesh, real, total = pool.mesh, pool.real, pool.total
  n, local = mesh.size, total // mesh.size
  per, extra = seats
  riding = {} if rider is None else _widths(rider.ins)  # The rider's in-bundles, by dtype.
  by_dtype = lambda parts, dtype: next(
      b for b, m in enumerate(_bundles(parts)) if parts[m[0]].dtype == dtype
  )
  # The rider's slots: the pool's padding, or ``extra`` more after each device's ``local``.
  by_device = lambda x: x.reshape(n, -1, *x.shape[1:])
  joined = lambda mine, theirs: _flat(jnp.concatenate([by_device(mine), by_device(theirs)], 1))
  ours = (lambda x: _flat(by_device(x)[:, :local])) if extra else (lambda x: x)
  theirs_of = lambda x: _flat(by_device(x)[:, local:]) if extra else x[real:]

  def padded_in(b: int) -> jax.Array:
    pieces = pool.pieces_in(b)
    dtype = pool.ins[pool.bundles_in[b][0]].dtype
    if dtype not in riding:
      return padded(pieces, total)
    ride = rider.pieces_in(by_dtype(rider.ins, dtype))
    if extra:
      return joined(padded(pieces, total), _seated(ride, per, n * extra, pieces.shape[-1]))
    return jnp.concatenate([pieces, _seated(ride, per, total - real, pieces.shape[-1])])

  moved_in = [
      gated(
          pool.ins[members[0]].when,
          lambda b=b: pool.move(
              pool.place(padded_in(b), P(*pool.spread_pieces)),
              pool.spread_pieces,
              pool.dealt_pieces,
          ),
      )
      for b, members in enumerate(pool.bundles_in)
  ]
  # The probes' tables: each device draws its slots' tiles in the body, where its work reads them.
  probes = {
      j: draws.pooled_tables([(r.arrays[j], r.blocks) for r in pool.ordered], total, pool.hold)
      for j in pool.drawn
  }
  rider_per_block = [] if rider is None else rider.per_block

  def body(bundles, probes, per_block, rider_per_block, held):
    device = jax.lax.axis_index(pool.axes)
    outs, held = pool.inner(
        [b[:local] for b in bundles], probes, per_block, device * local, local, (0, total), held
    )
    if rider is None:
      return outs, held
    slots = lambda b: b[local:] if extra else b  # Where the rider's tiles sit.
    seen = [_unseated(slots(bundles[by_dtype(pool.ins, d)]), per, w) for d, w in riding.items()]
    if extra:
      start, count, span = device * extra * per, extra * per, (0, n * extra * per)
    else:
      start, count = (device * local - real) * per, local * per
      span = (-real * per, (total - real) * per)
    theirs, _ = rider.inner(seen, {}, rider_per_block, start, count, span)
    padding = (device * local + jnp.arange(local) >= real).reshape(-1, 1, 1)
    for x in theirs:
      b = by_dtype(pool.outs_spec, x.dtype)
      if extra:
        outs[b] = jnp.concatenate([outs[b], _seated(x, per, extra, outs[b].shape[-1])])
      else:
        outs[b] = jnp.where(padding, _seated(x, per, local, outs[b].shape[-1]), outs[b])
    return outs, held

  body = jax.shard_map(
      body,
      mesh=mesh,
      in_specs=(P(*pool.dealt_pieces), pool.dealt, P(), P(), pool.dealt),
      out_specs=(P(*pool.dealt_pieces), pool.dealt),
      check_vma=False,
  )
  moved_out, held = body(moved_in, probes, pool.per_block, rider_per_block, pool.resident)
  bundles_out = _bundles(pool.outs_spec)
  flagged = lambda flag: [b for b, m in enumerate(bundles_out) if pool.outs_spec[m[0]].when is flag]
  back = lambda flag: {
      b: pool.move(moved_out[b], pool.dealt_pieces, pool.spread_pieces) for b in flagged(flag)
  }
  always = back(None)
  parts = lambda moved: _unbundled(
      pool.outs_spec, [bundles_out[b] for b in moved], [ours(x) for x in moved.values()]
  )
  results = [pool.finish(lambda flag: parts(always if flag is None else back(flag)))]
  if held is not None:  # Each run's new stacks: the pool's new state, kept where it runs.
    results = [(results[0][0], [jax.tree.map(pool.hold, held)] * len(pool.runs))]
  if rider is not None:
    theirs = _bundles(rider.outs_spec)
    seen = [
        _unseated(theirs_of(always[by_dtype(pool.outs_spec, rider.outs_spec[m[0]].dtype)]), per, w)
        for m, w in zip(theirs, [sum(rider.outs_spec[i].width for i in m) for m in theirs])
    ]
    got = _unbundled(rider.outs_spec, theirs, [x[: rider.real] for x in seen])
    results.append(rider.finish(lambda flag: got))
  return results


def _stack(*xs: jax.Array) -> jax.Array:
  return jnp.stack(xs)


def _flat(x: jax.Array) -> jax.Array:
  """A group's ``(k, n, ...)`` stacks as ``(k * n, ...)``."""
  return x.reshape(-1, *x.shape[2:])


def _seated(pieces: jax.Array, per: int, slots: int, width: int) -> jax.Array:
  """A rider's pieces ``(k, N, w)`` (padded with copies of the last tile to ``slots * per``),
  ``per`` tiles side by side in each of ``slots`` slots ``width`` wide: ``(slots, N, width)``.

  Example:
      >>> pieces = jnp.arange(6.0).reshape(3, 1, 2)
      >>> _seated(pieces, 2, 2, 5)[:, 0].tolist()
      [[0.0, 1.0, 2.0, 3.0, 0.0], [4.0, 5.0, 4.0, 5.0, 0.0]]
      >>> _unseated(_seated(pieces, 2, 2, 5), 2, 2)[:3].tolist() == pieces.tolist()
      True
  """
  k, n, w = pieces.shape
  x = jnp.swapaxes(padded(pieces, slots * per).reshape(slots, per, n, w), 1, 2)
  return jnp.pad(x.reshape(slots, n, per * w), ((0, 0), (0, 0), (0, width - per * w)))


def _unseated(slots: jax.Array, per: int, w: int) -> jax.Array:
  """The rider's pieces that :func:`_seated` put in ``slots``: ``(len(slots) * per, N, w)``."""
  s, n, _ = slots.shape
  return jnp.swapaxes(slots[..., : per * w].reshape(s, n, per, w), 1, 2).reshape(s * per, n, w)


class _Part(NamedTuple):
  """One array a pool moves, as pieces: moved only when ``when`` holds (None: every step),
  its dtype, its pieces' width, its name, and (for a stack) how it is seen as pieces."""

  when: Any
  dtype: Any
  width: int
  name: tuple
  layout: Layout | None


def _bundles(parts: Sequence[_Part]) -> list[list[int]]:
  """The indices of ``parts`` grouped by their flag (the same object) and dtype, in order of
  first appearance: each group moves as one array, concatenated along the pieces' dim.

  Example:
      >>> part = lambda when, dtype: _Part(when, dtype, 1, (), None)
      >>> flag = jnp.bool_(True)
      >>> _bundles([part(None, "f4"), part(flag, "f4"), part(None, "f4"), part(None, "bf16")])
      [[0, 2], [1], [3]]
  """
  groups: dict[tuple, list[int]] = {}
  for i, part in enumerate(parts):
    groups.setdefault((id(part.when), part.dtype), []).append(i)
  return list(groups.values())


def _widths(parts: Sequence[_Part]) -> dict:
  """Each bundle's width (its parts' pieces side by side), by dtype: a free pool's bundles,
  one per dtype (:attr:`_Pool.free`)."""
  return {parts[m[0]].dtype: sum(parts[i].width for i in m) for m in _bundles(parts)}


def _unbundled(parts: Sequence[_Part], groups: Sequence[list[int]], bundles) -> dict:
  """Each part's pieces, by name, cut from ``bundles`` (one array per group of ``groups``, its
  parts' pieces side by side)."""
  out = {}
  for bundle, group in zip(bundles, groups):
    ends = np.cumsum([parts[i].width for i in group])
    for i, end in zip(group, ends):
      out[parts[i].name] = bundle[..., end - parts[i].width : end]
  return out


def _stack_layout(shape: tuple, axes: tuple, sizes: dict[str, int]) -> Layout:
  """How a pool's stack of factors of ``shape`` is split (spread along its own dims) when it
  moves as pieces."""
  return Layout(tuple(shape), spread(shape, axes, sizes), tuple(axes), tuple(sizes.items()))


def drawn_in_place(runs: Sequence[BlockRun]) -> set[int]:
  """The arrays (indices) that a pool of ``runs`` draws in place: a
  :class:`~bv_sharding.optimizers.draws.TileNormal` in every run."""
  count = len(runs[0].arrays)
  return {j for j in range(count) if all(isinstance(r.arrays[j], draws.TileNormal) for r in runs)}


def _layout(blocks: ShardBlocks, tile_spec: tuple, axes: tuple) -> Layout:
  """How a group's tile stack is split when it becomes pieces: as cutting on ``tile_spec``
  leaves it (:func:`_tiles_tail`), else spread over ``axes`` on its tile dims."""
  sizes = dict(blocks.mesh.shape)
  natural = _tiles_tail(blocks, tile_spec)
  if natural is None:
    return _stack_layout(blocks.sizes, axes, sizes)
  return Layout(blocks.sizes, tuple(natural[1:]), tuple(axes), tuple(sizes.items()))


def _param_spec(blocks: ShardBlocks) -> tuple:
  """A group's stacked params' spec: the group's dim, then the param's spec, padded."""
  return (None, *blocks.spec, *(None,) * (len(blocks.shape) - len(blocks.spec)))


def _chosen(kinds: jax.Array, options: Sequence[jax.Array]) -> jax.Array:
  """Each slot (dim 0) of ``options[kinds[slot]]``.

  Example:
      >>> _chosen(jnp.array([1, 0]), [jnp.zeros((2, 3)), jnp.ones((2, 3))]).sum(1).tolist()
      [3.0, 0.0]
  """
  picked = options[0]
  for k, option in enumerate(options[1:], 1):
    picked = jnp.where((kinds == k).reshape(-1, *(1,) * (option.ndim - 1)), option, picked)
  return picked


def _tiles_tail(blocks: ShardBlocks, tile_spec: tuple) -> tuple | None:
  """Where cutting a param on ``tile_spec`` (a group's, its dim 0 the group's) leaves its tile
  stack ``(n, *tile)``: each tile dim split as its param dim is, when each divides; None when
  one does not."""
  entries = tile_spec[1 + int(blocks.scanned) :]
  sizes = dict(blocks.mesh.shape)
  for size, entry in zip(blocks.sizes, entries):
    if size % math.prod(sizes[a] for a in stack_axes((entry,))):
      return None
  return (None, *entries)


def _tile_spec(blocks: ShardBlocks, sizes: dict[str, int]) -> P:
  """Where a pooled param is cut into tiles: its own spec where each dim's shards keep in
  step with the tiles (each shard whole tiles, or whole pieces of one tile); else all its
  mesh axes (in mesh order) on the first dim they keep in step; without such a dim, its spec
  with each axis out of step moved to a dim it keeps in step, else dropped (gathered over).

  Cutting the param into tiles is then a reshape XLA partitions as it is, and the tiles
  reach the pool as pieces in one all-to-all; a moved axis costs another (each of about a
  shard's bytes).

  Example:
      >>> mesh = jax.sharding.AbstractMesh((4, 2), ("data", "model"))
      >>> blocks = ShardBlocks((768, 256), (1, 1), 256, spec=("model", "data"), pooled=True)
      >>> _tile_spec(blocks, dict(mesh.shape))  # 384-row shards: all on the columns
      P(None, ('data', 'model'))
      >>> head = ShardBlocks((128, 256), (1, 1), 256, spec=(None, "data"), pooled=True)
      >>> _tile_spec(head, dict(mesh.shape))  # 64-column pieces of its one tile: kept
      P(None, 'data')
  """
  dims = range(int(blocks.scanned), len(blocks.shape))
  entries = [list(stack_axes((e,))) for e in blocks.spec]
  own = {a for d in dims for a in entries[d]}
  ordered = [a for a in sizes if a in own]
  in_step = lambda d, axes: _in_step(
      blocks.shape[d], math.prod(sizes[a] for a in axes), blocks.block_size
  )
  if all(in_step(d, entries[d]) for d in dims):
    return P(*blocks.spec)
  together = next((d for d in dims if in_step(d, ordered)), None)
  if together is not None:
    return P(
        *(
            spec_entry(ordered if d == together else entries[d] if d not in dims else [])
            for d in range(len(entries))
        )
    )
  moved = [a for d in dims for a in entries[d] if not in_step(d, entries[d])]
  for d in dims:
    entries[d] = [a for a in entries[d] if a not in moved]
  for axis in moved:
    d = next((d for d in dims if in_step(d, [*entries[d], axis])), None)
    if d is not None:
      entries[d].append(axis)
  return P(*(spec_entry(e) for e in entries))


def _in_step(extent: int, shards: int, block_size: int) -> bool:
  """Whether ``shards`` even shards of a dim of ``extent`` hold whole tiles or whole
  pieces of one tile each."""
  if extent % shards:
    return False
  local = extent // shards
  return local % block_size == 0 or (
      block_size % local == 0 and extent % min(block_size, extent) == 0
  )
