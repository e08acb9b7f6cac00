"""Muon with scanned layers and owner-computed orthogonalisation.

``optax.contrib.muon`` treats only 2-D leaves as matrices by default, so the
stacked ``(L, m, n)`` kernels of ``scan_layers=True`` silently train with its Adam
branch. Here every leaf with at least 2 dims that is not a norm ``scale`` or a
``bias`` is a batch of matrices over its last two dims (leading axes are batch
axes, one matrix per layer), scanned or not; the rest (vectors, scalars, norm scales
and biases of any rank) train with Adam, in :func:`muon` and in :func:`scale_by_muon`
alike. So do the input embedding and the output head, matrices or not (``adam_leaves``,
:data:`ADAM_LEAVES`), as Muon's authors train them. On a ViT that reads: a 4-D conv
kernel ``(kh, kw, in, out)`` is ``kh * kw`` matrices ``(in, out)``, one per filter tap; a
3-D attention kernel ``(in, heads, head_dim)`` is ``in`` matrices ``(heads, head_dim)`` and
``(heads, head_dim, out)`` one ``(head_dim, out)`` matrix per head; a scanned ``(L, m, n)``
stack one matrix per layer.

Newton-Schulz needs whole matrices. Without a layout every device orthogonalises
every matrix (GSPMD gathers them). With ``layout`` (the params' specs and mesh, see
:mod:`bv_sharding.optimizers.layout`) the matrices of one shape are stacked (each first
moved to the layout most of them have), padded to a multiple of the device count and split
over all mesh axes: each matrix has one owner, which receives it whole, orthogonalises it and
sends it back, the stack moved one run of mesh axes at a time each way
(:mod:`bv_sharding.optimizers.moves`: all-to-alls of about a shard's bytes, where the update
was once all-gathered whole), then cut into its params, each moved to its own spec. Per-device
Newton-Schulz FLOPs are ``ceil(K / N) / K`` of the total for K matrices of a shape.

The momentum (and the AdamW branch's moments) are stored in the params' dtype; under a config-built
loop in ``config.state_dtype``, with Newton-Schulz and the moment updates run in
float32 (:mod:`bv_sharding.optimizers.state_dtype`).

Example:
    >>> import jax.numpy as jnp
    >>> tx = muon(0.02)
    >>> params = {"w": jnp.ones((3, 4, 4)), "ln": {"scale": jnp.ones((3, 4))}}
    >>> state = tx.init(params)
    >>> updates, state = tx.update(params, state, params)
    >>> matrix_dims(params)["w"], matrix_dims(params)["ln"]["scale"]
    (MuonDimensionNumbers(reduction_axis=1, output_axis=2), None)
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from optax.contrib import MuonDimensionNumbers
from optax.contrib._muon import orthogonalize_via_newton_schulz, scale_by_shape

from bv_sharding.errors import OptimizerError
from bv_sharding.ops import axes_of
from bv_sharding.optimizers import opaque
from bv_sharding.optimizers.layout import ParamLayout
from bv_sharding.optimizers.moves import move

_NOT_MATRICES = ("scale", "bias")
# Leaves trained with Adam although they are matrices: any key of their path fully matches this
# regex. The input embedding and the output head ("Muon should only be used for hidden weight
# layers": Keller Jordan's Muon; Moonlight alike): the Llama's embed/embedding and lm_head/kernel,
# a ViT's patch embedding/kernel, pos_embedding and head/kernel. "" (or None): none. On the
# tuning split (docs/optimizers.md), two seeds: eval loss 1.468 against 1.497 with every matrix
# orthogonalised; 0.69x the update's FLOPs on a 134M-param Llama with a 32000-token vocabulary.
ADAM_LEAVES = "embed|embedding|pos_embedding|lm_head|head"
_NS_COEFFS = (3.4445, -4.775, 2.0315)
# The RMS each matrix's update is scaled to (times the learning rate), so that Muon trains at
# AdamW's learning rate. Moonlight's 0.2 (AdamW's typical RMS) undershoots there:
# the project's small language model, 300 steps, eval loss 1.739 at 0.2, 1.521 at 0.6,
# 1.496 at 0.8, 1.503 at 1.1, 1.554 at 1.6; adamw 1.640. Re-checked on the tuning split
# (docs/optimizers.md, "How the defaults were chosen"), two seeds: 1.560 at 0.4, 1.497 at
# 0.8, 1.516 at 1.2.
CONSISTENT_RMS = 0.8


def matrix_dims(params, adam_leaves: str | None = ADAM_LEAVES) -> Any:
  """Per leaf: its matrix dims (the last two; leading dims are batch), or None for Adam.

  Leaves with fewer than 2 dims, leaves named ``scale`` or ``bias`` and leaves with a path key
  that ``adam_leaves`` (a regex, :data:`ADAM_LEAVES`) fully matches are not matrices.

  Example:
      >>> dims = matrix_dims({"conv": jnp.ones((2, 2, 3, 8)), "b": jnp.ones(8), "s": jnp.ones(())})
      >>> dims["conv"], dims["b"], dims["s"]
      (MuonDimensionNumbers(reduction_axis=2, output_axis=3), None, None)
      >>> llama = {"embed": {"embedding": jnp.ones((8, 4))}, "lm_head": {"kernel": jnp.ones((4, 8))}}
      >>> matrix_dims(llama)
      {'embed': {'embedding': None}, 'lm_head': {'kernel': None}}
      >>> matrix_dims(llama, adam_leaves="")["lm_head"]["kernel"]  # "": orthogonalise them too
      MuonDimensionNumbers(reduction_axis=0, output_axis=1)
  """
  pattern = _adam_pattern(adam_leaves)

  def dims(path, leaf):
    keys = [jax.tree_util.keystr((k,), simple=True) for k in path]
    if leaf.ndim < 2 or (keys and keys[-1] in _NOT_MATRICES):
      return None
    if pattern is not None and any(pattern.fullmatch(k) for k in keys):
      return None
    return MuonDimensionNumbers(leaf.ndim - 2, leaf.ndim - 1)

  return jax.tree_util.tree_map_with_path(dims, params)


def _adam_pattern(adam_leaves: str | None) -> re.Pattern | None:
  """``adam_leaves`` compiled (None for "" or None); an ``OptimizerError`` if it is no regex.

  Example:
      >>> _adam_pattern("embed|head").fullmatch("lm_head") is None
      True
  """
  if not adam_leaves:
    return None
  try:
    return re.compile(adam_leaves)
  except (re.error, TypeError) as e:
    raise OptimizerError(
        f"muon's adam_leaves={adam_leaves!r} is not a regular expression ({e}); give one "
        f"that fully matches the path keys of the leaves to train with Adam, e.g. "
        f"{ADAM_LEAVES!r}, or '' for none"
    ) from e


def _is_dims(x) -> bool:
  return x is None or isinstance(x, MuonDimensionNumbers)


class MuonState(NamedTuple):
  count: jax.Array
  mu: Any


def _as_matrices(x: jax.Array) -> jax.Array:
  """``(..., m, n)`` as ``(batch, m, n)`` with ``m <= n`` (Newton-Schulz's cheap side)."""
  if x.ndim < 2:
    raise OptimizerError(
        f"Muon orthogonalises matrices; got a leaf of shape {x.shape} ({x.ndim} dims). Mask it "
        "out (matrix_dims gives None for it) or use muon / scale_by_muon, which give such "
        "leaves Adam"
    )
  x = x.reshape(-1, *x.shape[-2:])
  return x if x.shape[1] <= x.shape[2] else x.transpose(0, 2, 1)


def _from_matrices(x: jax.Array, shape) -> jax.Array:
  if shape[-2] > shape[-1]:
    x = x.transpose(0, 2, 1)
  return x.reshape(shape)


def orthogonalize(tree, dims, ns: Callable[[jax.Array], jax.Array], layout=None):
  """``ns`` applied to every matrix of the leaves whose ``dims`` entry is not masked.

  With a concrete mesh in ``layout``, matrices of one shape are stacked and split over
  all mesh axes (one owner each) in rounds of one matrix per device; the matrices left
  over from every shape's last round are zero-padded to a common shape (exact:
  Newton-Schulz keeps zero rows and columns zero) and share rounds. Results go back to
  their params' specs.
  """
  leaves, treedef = jax.tree.flatten(tree, is_leaf=_is_masked)
  dims = treedef.flatten_up_to(dims)
  mesh = layout.mesh if layout is not None else None
  specs = treedef.flatten_up_to(layout.specs) if layout is not None else None
  owners = mesh.size if isinstance(mesh, jax.sharding.Mesh) and mesh.size > 1 else 1
  groups: dict[tuple[int, int], list[int]] = {}
  for i, (x, d) in enumerate(zip(leaves, dims)):
    if not _is_masked(d):
      groups.setdefault(tuple(sorted(x.shape[-2:])), []).append(i)
  stacks = {i: _as_matrices(leaves[i]) for members in groups.values() for i in members}
  spec_of = lambda i: _matrix_spec(specs[i], leaves[i].shape) if owners > 1 else None
  pieces: dict[int, list[jax.Array]] = {i: [] for i in stacks}
  left = []  # (leaf, matrices, their matrix spec as held) of every shape's last round
  longest = max(map(len, groups.values()), default=0)
  index = opaque.indices(longest, mesh) if owners > 1 else None
  for members in groups.values():
    spec = _shared([spec_of(i) for i in members])
    # Members held alike side by side, the shared layout's first: each run moves as one.
    runs = _runs(members, spec_of, spec)
    stack = jnp.concatenate(
        [_moved(jnp.concatenate([stacks[i] for i in run]), mesh, held, spec) for held, run in runs]
    )
    full = stack.shape[0] // owners * owners
    done = _owned(ns, stack[:full], mesh, spec, spec) if full else stack[:0]
    start = 0
    for held, run in runs:
      n = sum(stacks[i].shape[0] for i in run)
      mine = _moved(done[min(start, full) : min(start + n, full)], mesh, spec, held)
      at = start
      for position, i in enumerate(run):
        k = stacks[i].shape[0]
        lo, hi = min(at, full), min(at + k, full)
        if hi > lo:
          pieces[i].append(_piece(mine, lo - start, hi - lo, position, index))
        if at + k > full:
          left.append((i, stack[max(at, full) : at + k], held if spec is None else spec))
        at += k
      start += n
  if left:
    m = max(x.shape[1] for _, x, _ in left)
    n = max(x.shape[2] for _, x, _ in left)
    padded = [jnp.pad(x, ((0, 0), (0, m - x.shape[1]), (0, n - x.shape[2]))) for _, x, _ in left]
    spec = _common([held for _, _, held in left])
    cut = {d for _, x, _ in left for d, size in enumerate(x.shape[1:]) if size < (m, n)[d]}
    back = _uncut(spec, cut, (m, n), mesh)
    done, start = _owned(ns, jnp.concatenate(padded), mesh, spec, back), 0
    for i, x, _ in left:
      piece = done[start : start + x.shape[0], : x.shape[1], : x.shape[2]]
      pieces[i].append(_moved(piece, mesh, back, spec_of(i)))
      start += x.shape[0]
  out = list(leaves)
  for i, parts in pieces.items():
    piece = _from_matrices(jnp.concatenate(parts), leaves[i].shape)
    if owners > 1:
      piece = jax.lax.with_sharding_constraint(piece, NamedSharding(mesh, specs[i]))
    out[i] = piece
  return treedef.unflatten(out)


def _piece(stack: jax.Array, offset: int, size: int, position: int, index) -> jax.Array:
  """``stack[offset : offset + size]``: the matrices of a run's member at ``position``, read
  at an index XLA cannot see (``index``, :func:`~bv_sharding.optimizers.opaque.indices`) where
  the members before it are all of its size, so like members share their kernels."""
  if index is None or offset != position * size:
    return stack[offset : offset + size]
  return jax.lax.dynamic_slice_in_dim(stack, index[position] * size, size)


def _matrix_spec(spec: P, shape) -> tuple | None:
  """Mesh axes of the rows and columns of :func:`_as_matrices` of a leaf with ``spec``.

  None when a leading (batch) dim is sharded: the stack's dim 0 is then sharded already.

  Example:
      >>> _matrix_spec(P("data", "model"), (768, 256)), _matrix_spec(P("layers"), (2, 4, 4))
      (('model', 'data'), None)
  """
  entries = tuple(spec) + (None,) * (len(shape) - len(spec))
  if any(entries[:-2]):
    return None
  rows, cols = entries[-2:]
  return (cols, rows) if shape[-2] > shape[-1] else (rows, cols)


def _common(specs: list) -> tuple | None:
  """The matrix spec the zero-padded leftovers of several shapes share, as held
  (:func:`orthogonalize`); None where they differ over one mesh axis (or one is None).

  Members that differ over several mesh axes give ``(None, None)``: the stack is gathered
  whole before it is dealt to owners (left to XLA, the move from its choice of sharding for the
  concatenation is an involuntary full rematerialization: a ViT's attention and conv kernels
  on a 4x2 mesh).

  Example:
      >>> _common([("data", "model"), ("model", None)])
      (None, None)
      >>> _common([("data", None), (None, "data")]) is None
      True
  """
  if len(set(specs)) == 1:
    return specs[0]
  if None in specs:
    return None
  placed = {a for spec in specs for entry in spec for a in axes_of(entry)}
  return (None, None) if len(placed) > 1 else None


def _runs(members: list[int], spec_of: Callable, spec: tuple | None) -> list[tuple]:
  """``members`` as runs of one matrix spec each, ``(spec, members)``: ``spec``'s first, the
  others in order of first appearance.

  Example:
      >>> specs = {0: ("data", None), 1: (None, "data"), 2: ("data", None), 3: (None, "data")}
      >>> _runs([0, 1, 2, 3], specs.get, ("data", None))
      [(('data', None), [0, 2]), ((None, 'data'), [1, 3])]
  """
  held = list(dict.fromkeys([spec, *(spec_of(i) for i in members)]))
  runs = [(h, [i for i in members if spec_of(i) == h]) for h in held]
  return [(h, run) for h, run in runs if run]


def _shared(specs: list) -> tuple | None:
  """The matrix spec most of ``specs`` have (the first such, on a tie); None if one is None.

  Example:
      >>> _shared([("data", None), (None, "data"), ("data", None)])
      ('data', None)
  """
  if None in specs:
    return None
  return max(specs, key=specs.count)


def _moved(stack: jax.Array, mesh, src: tuple | None, dst: tuple | None) -> jax.Array:
  """``stack`` of matrices from the matrix spec ``src`` to ``dst``
  (:func:`~bv_sharding.optimizers.moves.move`); as it is when either is None.

  Example:
      >>> _moved(jnp.ones((2, 4, 4)), None, ("data", None), None).shape
      (2, 4, 4)
  """
  if src is None or dst is None or src == dst:
    return stack
  return move(stack, mesh, (None, *src), (None, *dst))


def _to_owners(stack: jax.Array, mesh, spec: tuple | None) -> jax.Array:
  """``stack`` (``(K, m, n)`` matrices, ``K`` a multiple of the mesh size) split over all mesh
  axes on dim 0: one matrix per device and round.

  With the stack's matrix ``spec`` (the mesh axes of its rows and columns) known, the mesh axes
  move to dim 0 one run at a time (:func:`~bv_sharding.optimizers.moves.move`: an all-to-all
  each); without it (a stack whose batch dims are sharded) in one constraint. A stack of
  leftovers sharded differently over several axes comes gathered whole (``spec``
  ``(None, None)``, :func:`_common`): from XLA's choice of sharding for their concatenation, a
  move to dim 0 would be a replication anyway, and an involuntary one.
  """
  owners = (mesh.axis_names, None, None)
  if spec is None:
    return jax.lax.with_sharding_constraint(stack, NamedSharding(mesh, P(*owners)))
  return move(stack, mesh, (None, *spec), owners)


def _from_owners(done: jax.Array, mesh, spec: tuple | None) -> jax.Array:
  """``done`` (split over all mesh axes on dim 0) back on its matrix ``spec`` with dim 0
  whole (:func:`~bv_sharding.optimizers.moves.move`: all-to-alls of about a shard's bytes), or
  gathered whole without a ``spec``. Either way dim 0 ends unsplit, so cutting it back into
  leaves is local: slicing the owner-split stack directly trips XLA's SPMD partitioner (an
  out-of-bounds slice at verification).
  """
  if spec is None:
    return jax.lax.with_sharding_constraint(done, NamedSharding(mesh, P()))
  return move(done, mesh, (mesh.axis_names, None, None), (None, *spec))


def _owned(ns, stack: jax.Array, mesh, spec: tuple | None, back: tuple | None) -> jax.Array:
  """``ns`` on every matrix of ``stack``; on a mesh, padded to whole rounds and split over it.

  ``spec``: the mesh axes of the stack's rows and columns where known (:func:`_to_owners`);
  the results come back on the matrix spec ``back``, or gathered whole where it is None
  (:func:`_from_owners`).
  """
  count = stack.shape[0]
  if isinstance(mesh, jax.sharding.Mesh) and mesh.size > 1:
    stack = _to_owners(jnp.pad(stack, ((0, -count % mesh.size), (0, 0), (0, 0))), mesh, spec)
    done = jax.vmap(ns)(stack)
    return _from_owners(done, mesh, back)[:count]
  return jax.vmap(ns)(stack)[:count]


def _uncut(spec: tuple | None, cut: set[int], shape: tuple[int, int], mesh) -> tuple | None:
  """A matrix spec for cutting leftovers zero-padded to ``shape`` back to their own shapes along
  the matrix dims ``cut``: ``spec`` with the cut dims' mesh axes moved after the other dim's
  (slicing a sharded dim would move data); None (gathered whole) when both dims are cut, the
  other dim does not divide, or ``spec`` is None.

  Example:
      >>> mesh = jax.sharding.AbstractMesh((4, 2), ("data", "model"))
      >>> _uncut(("data", "model"), {1}, (256, 768), mesh)
      (('data', 'model'), None)
      >>> _uncut(("data", "model"), {0, 1}, (256, 768), mesh) is None
      True
  """
  if spec is None or not cut:
    return spec
  kept = [d for d in range(2) if d not in cut]
  if not kept:
    return None
  axes = [a for d in (kept[0], *sorted(cut)) for a in axes_of(spec[d])]
  sizes = dict(mesh.shape)
  if shape[kept[0]] % math.prod(sizes[a] for a in axes):
    return None
  out = [None, None]
  out[kept[0]] = tuple(axes) if len(axes) > 1 else (axes[0] if axes else None)
  return tuple(out)


def scale_by_muon(
    ns_coeffs=_NS_COEFFS,
    ns_steps: int = 5,
    beta: float = 0.95,
    eps: float = 1e-8,
    nesterov: bool = True,
    layout: ParamLayout | None = None,
    adam_b1: float = 0.9,
    adam_b2: float = 0.999,
    consistent_rms: float | None = CONSISTENT_RMS,
    adam_leaves: str | None = ADAM_LEAVES,
) -> optax.GradientTransformation:
  """Muon's direction for every matrix (:func:`matrix_dims`), Adam's for the other leaves.

  The form big_vision's chains take (no learning rate, no weight decay): on any tree, the
  leaves :func:`muon` orthogonalises get the same orthogonalised momentum scaled to
  ``consistent_rms`` (:data:`CONSISTENT_RMS`), and the others (vectors, scalars, norm scales,
  biases, the leaves ``adam_leaves`` names: :data:`ADAM_LEAVES`) ``optax.scale_by_adam`` with
  ``adam_b1``, ``adam_b2``, ``eps`` and ``nesterov``, as :func:`muon`'s Adam branch before its
  learning rate. ``layout``: each matrix orthogonalised by one owner device (module docstring).

  Example:
      >>> tx = scale_by_muon()
      >>> params = {"w": jnp.ones((4, 4)), "ln": {"scale": jnp.ones(4)}, "t": jnp.ones(())}
      >>> updates, _ = tx.update(params, tx.init(params), params)
      >>> [u.shape for u in jax.tree.leaves(updates)]
      [(4,), (), (4, 4)]
      >>> half, _ = scale_by_muon(consistent_rms=0.4).update(params, tx.init(params), params)
      >>> float(updates["w"][0, 0] / half["w"][0, 0])  # each matrix scaled to consistent_rms
      2.0
  """
  return optax.partition(
      {
          "muon": optax.chain(
              _orthogonalised_momentum(ns_coeffs, ns_steps, beta, eps, nesterov, layout),
              _shape_scaled(consistent_rms),
          ),
          "adam": optax.scale_by_adam(adam_b1, adam_b2, eps, nesterov=nesterov),
      },
      _labels(adam_leaves),
  )


def _shape_scaled(consistent_rms: float | None) -> optax.GradientTransformation:
  """optax's ``scale_by_shape`` of each matrix's update, on its last two dims: to RMS
  ``consistent_rms``, or (None) by ``sqrt(max(1, fan_out / fan_in))``."""
  dims = lambda u: jax.tree.map(_last_two, u, is_leaf=_is_masked)
  return scale_by_shape(dims, consistent_rms)


def _labels(adam_leaves: str | None) -> Callable[[Any], Any]:
  """Params to ``"muon"`` for the leaves :func:`matrix_dims` calls matrices, else ``"adam"``
  (``adam_leaves`` checked now, when the optimizer is built)."""
  _adam_pattern(adam_leaves)

  def labels(params):
    dims = matrix_dims(params, adam_leaves)
    return jax.tree.map(lambda d: "adam" if d is None else "muon", dims, is_leaf=_is_dims)

  return labels


def _orthogonalised_momentum(
    ns_coeffs, ns_steps: int, beta: float, eps: float, nesterov: bool, layout
) -> optax.GradientTransformation:
  """Momentum, then Newton-Schulz orthogonalisation of every leaf (optax's iteration).

  Same momentum and bias correction as ``optax.contrib.scale_by_muon``; every leaf
  is treated as a batch of matrices over its last two dims. The coefficients stay on the
  host until traced (building it moves nothing to a device: big_vision's ``train.py``
  disallows transfers).
  """
  coeffs = np.asarray(ns_coeffs, np.float32)
  ns = lambda x: orthogonalize_via_newton_schulz(x, coeffs, ns_steps, "frobenius", eps)

  def init_fn(params):
    return MuonState(jnp.zeros([], jnp.int32), optax.tree.zeros_like(params))

  def update_fn(updates, state, params=None):
    del params
    mu = optax.tree.update_moment(updates, state.mu, beta, 1)
    count = optax.safe_increment(state.count)
    if nesterov:
      mu_hat = jax.tree.map(
          lambda m, g: beta * m + (1 - beta) * g,
          optax.tree.bias_correction(mu, beta, optax.safe_increment(count)),
          optax.tree.bias_correction(updates, beta, count),
      )
    else:
      mu_hat = optax.tree.bias_correction(mu, beta, count)
    dims = jax.tree.map(_last_two, mu_hat, is_leaf=_is_masked)
    return orthogonalize(mu_hat, dims, ns, layout), MuonState(count, mu)

  return optax.GradientTransformation(init_fn, update_fn)


def muon(
    learning_rate: optax.ScalarOrSchedule,
    ns_coeffs=_NS_COEFFS,
    ns_steps: int = 5,
    beta: float = 0.95,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    weight_decay_mask: Any | None = None,
    nesterov: bool = True,
    adam_b1: float = 0.9,
    adam_b2: float = 0.999,
    adam_learning_rate: optax.ScalarOrSchedule | None = None,
    consistent_rms: float | None = CONSISTENT_RMS,
    layout: ParamLayout | None = None,
    adam_leaves: str | None = ADAM_LEAVES,
) -> optax.GradientTransformation:
  """Muon on every matrix (:func:`matrix_dims`), AdamW on the rest.

  Arguments as ``optax.contrib.muon``'s, but ``consistent_rms`` is :data:`CONSISTENT_RMS`
  (optax's None scales by width only); ``layout`` gives each matrix an owner device (see the
  module docstring). ``adam_learning_rate`` defaults to ``learning_rate``. ``adam_leaves``: a
  regex; a leaf with a path key it fully matches trains with AdamW (:data:`ADAM_LEAVES`: the
  input embedding and the output head; ``""``: every matrix with Muon). Weight decay reaches
  the leaves of ``weight_decay_mask`` in either branch, by default every matrix (those
  :func:`matrix_dims` gives dims without ``adam_leaves``).

  Example:
      >>> tx = muon(0.02, weight_decay=0.1)
      >>> params = {"w": jnp.ones((4, 4)), "b": jnp.zeros(4)}
      >>> updates, _ = tx.update(params, tx.init(params), params)
  """

  return optax.partition(
      {
          "muon": optax.chain(
              _orthogonalised_momentum(ns_coeffs, ns_steps, beta, eps, nesterov, layout),
              _shape_scaled(consistent_rms),
              optax.add_decayed_weights(weight_decay, weight_decay_mask),
              optax.scale_by_learning_rate(learning_rate),
          ),
          "adam": optax.adamw(
              learning_rate if adam_learning_rate is None else adam_learning_rate,
              b1=adam_b1,
              b2=adam_b2,
              eps=eps,
              weight_decay=weight_decay,
              mask=_matrices if weight_decay_mask is None else weight_decay_mask,
              nesterov=nesterov,
          ),
      },
      _labels(adam_leaves),
  )


def _matrices(params) -> Any:
  """True for the leaves :func:`matrix_dims` calls matrices when ``adam_leaves`` names none.

  Example:
      >>> _matrices({"head": {"kernel": jnp.ones((4, 2)), "bias": jnp.ones(2)}})
      {'head': {'bias': False, 'kernel': True}}
  """
  return jax.tree.map(lambda d: d is not None, matrix_dims(params, None), is_leaf=_is_dims)


def _is_masked(x) -> bool:
  return isinstance(x, optax.MaskedNode)


def _last_two(x):
  """Matrix dims of a leaf the muon branch sees (the AdamW branch's leaves stay masked)."""
  return x if _is_masked(x) else MuonDimensionNumbers(x.ndim - 2, x.ndim - 1)
