"""The built-in sharding ops.

Each op is a factory registered by name; the config string's arguments go to the
factory, which returns ``rule(leaf, spec) -> (spec, note)``. Rules only add mesh
axes through :func:`bv_sharding.ops.place`, so chains compose: a later op only
fills dims and axes an earlier one left free. ``replicate`` is the one exception:
it clears what an earlier op placed (big_vision rejects such a chain).

``fsdp``, ``shard_dim``, ``replicate`` and ``logical_partitioning`` are
big_vision's ops and place params as big_vision's do (arguments, defaults,
threshold and tie-breaking included); ``docs/differences.md`` lists where they
deliberately do not.

Each op declares whether the axes it places on params only save memory
(``register(..., storage_only=...)``, see :mod:`bv_sharding.compute`): ``fsdp``,
``llm_fsdp`` and ``zero1`` place storage-only axes, gathered for compute under
Explicit axes; ``shard_dim``, ``tensor_parallel`` and ``logical_partitioning`` (but
for the axes its ``storage_only`` lists) place compute axes, which stay;
``replicate`` and ``preconditioner`` place none on params.

Example:
  >>> import jax
  >>> import bv_sharding as bvs
  >>> mesh = bvs.make_abstract_mesh([("data", 4), ("model", 2)], 8)
  >>> tree = {"attn": {"q_kernel": jax.ShapeDtypeStruct((1024, 2048), "float32")}}
  >>> p = bvs.plan(tree, 'tensor_parallel(axis="model")|fsdp(axis="data")', mesh)
  >>> p.specs, p.compute_specs
  ({'attn': {'q_kernel': P('data', 'model')}}, {'attn': {'q_kernel': P(None, 'model')}})
"""

import flax.linen as nn

from bv_sharding import following, names, specs
from bv_sharding.errors import ShardingError
from bv_sharding.registry import register
from bv_sharding.specs import Leaf, Spec

NEVER_SHARDED = names.NORM_AND_BIAS
LAST_DIM = frozenset({"embedding", "out_kernel", "down_kernel"})
SECOND_LAST_DIM = frozenset({"q_kernel", "k_kernel", "v_kernel", "gate_kernel", "up_kernel"})
# lm_head's vocab dim is column-parallel too (Megatron's parallel output embedding).
COLUMN_PARALLEL = SECOND_LAST_DIM | {"lm_head"}
ROW_PARALLEL = frozenset({"out_kernel", "down_kernel"})
VOCAB_PARALLEL = frozenset({"embedding"})


@register("replicate", follows=False)
def replicate():
  """Every dim replicated: ``'replicate()'`` or big_vision's bare ``'replicate'``.

  After another op in the same chain it replaces that op's axes (big_vision
  raises instead).
  """
  return lambda leaf, spec: ((None,) * leaf.ndim, "replicated")


@register("fsdp", storage_only=True)
def fsdp(axis, min_size_to_shard_mb=4):
  """big_vision's FSDP: the largest free dim ``axis`` divides, for leaves above the threshold.

  Storage-only: under Explicit axes consumers gather ``axis`` for compute.

  As in big_vision, a leaf of exactly ``min_size_to_shard_mb`` stays unsharded
  (only larger ones are sharded) and of equal dims the last one is taken.
  ``axis`` may be a tuple of mesh axes: ``'fsdp(axis=("data", "model"))'``.
  """
  axis = specs.check_axis("fsdp", axis)
  threshold = specs.check_number("fsdp", "min_size_to_shard_mb", min_size_to_shard_mb)

  def rule(leaf: Leaf, spec: Spec):
    note = specs.too_small(leaf, threshold, inclusive=True)
    return (spec, note) if note else specs.place_largest(leaf, spec, axis)

  return rule


@register("shard_dim")
def shard_dim(axis, dim, ignore_ndim_error=False):
  """``axis`` on dim ``dim`` (negative counts from the end): ``'shard_dim(axis="model", dim=-1)'``.

  A compute axis (kept in the compute spec), as a tensor-parallel placement needs;
  for a storage-only placement use ``fsdp`` or an op registered ``storage_only=True``.

  A leaf that has no dim ``dim`` raises, as in big_vision; with
  ``ignore_ndim_error=True`` it is left as it is and the plan says why.
  """
  axis = specs.check_axis("shard_dim", axis)
  if isinstance(dim, bool) or not isinstance(dim, int):
    raise ShardingError(f"shard_dim: dim must be an integer like 0 or -1, got {dim!r}")
  if ignore_ndim_error not in (True, False):  # bools, or 0/1 as big_vision's truthiness allows
    raise ShardingError(
        f"shard_dim: ignore_ndim_error must be True or False, got {ignore_ndim_error!r}"
    )

  def rule(leaf: Leaf, spec: Spec):
    if specs.normalize_dim(leaf, dim) is not None:
      return specs.place(leaf, spec, dim, axis)
    if ignore_ndim_error:
      return spec, f"no dim {dim} in shape {leaf.shape} (ignore_ndim_error): left as it is"
    raise ShardingError(
        f"leaf {leaf.name!r} {leaf.shape} has no dim {dim} for "
        f"shard_dim(axis={axis!r}, dim={dim}); narrow the strategy regex to leaves with "
        f"{abs(dim) + (dim >= 0)}+ dims or write "
        f"shard_dim(axis={axis!r}, dim={dim}, ignore_ndim_error=True)"
    )

  return rule


@register("llm_fsdp", storage_only=True)
def llm_fsdp(axis, min_size_to_shard_mb=1):
  """FSDP by parameter name, for Llama-style models; storage-only, as ``fsdp``.

  Matching is on whole path components: norm ``scale`` and ``bias`` are never
  sharded; ``embedding``/``out_kernel``/``down_kernel`` go on the last dim;
  ``q/k/v/gate/up_kernel`` on dim -2; any other leaf on the largest divisible of
  its last two dims. Dims count from the end, so a leading scanned-layer axis is
  never sharded. Only leaves with 2+ dims and at least the threshold are sharded:
  unlike ``fsdp`` (big_vision's ``>``), a leaf of exactly ``min_size_to_shard_mb``
  is sharded here (``>=``).
  """
  axis = specs.check_axis("llm_fsdp", axis)
  threshold = specs.check_number("llm_fsdp", "min_size_to_shard_mb", min_size_to_shard_mb)

  def rule(leaf: Leaf, spec: Spec):
    parts = set(leaf.components)
    if parts & NEVER_SHARDED:
      return spec, "norm scale or bias: never sharded"
    if leaf.ndim < 2:
      return spec, "fewer than 2 dims: not sharded"
    skip = _too_small(leaf, spec, threshold)
    if skip:
      return skip
    if parts & LAST_DIM:
      return specs.place(leaf, spec, -1, axis)
    if parts & SECOND_LAST_DIM:
      return specs.place(leaf, spec, -2, axis)
    return specs.place_largest(leaf, spec, axis, dims=(leaf.ndim - 2, leaf.ndim - 1))

  return rule


@register("tensor_parallel")
def tensor_parallel(axis):
  """Megatron layout over ``axis``: column-parallel q/k/v/gate/up and lm_head kernels (dim -1),
  row-parallel out/down kernels (dim -2), vocab-parallel embedding (dim -2).

  Compose with FSDP on another axis: ``'tensor_parallel(axis="model")|fsdp(axis="data")'``.
  ``axis`` is a compute axis: the compute spec keeps it.
  """
  axis = specs.check_axis("tensor_parallel", axis)

  def rule(leaf: Leaf, spec: Spec):
    parts = set(leaf.components)
    if leaf.ndim < 2 or parts & NEVER_SHARDED:
      return spec, "not a tensor-parallel kernel"
    if parts & COLUMN_PARALLEL:
      return specs.place(leaf, spec, -1, axis)
    if parts & (ROW_PARALLEL | VOCAB_PARALLEL):
      return specs.place(leaf, spec, -2, axis)
    return spec, "not a tensor-parallel kernel"

  return rule


@register("logical_partitioning", storage_only="storage_only")
def logical_partitioning(storage_only=None):
  """Axes from flax boxes: ``nn.with_logical_partitioning`` names resolved through the
  plan's ``rules`` (``config.sharding_rules``, else the flax context's
  ``nn.logical_axis_rules``) exactly as ``nn.logical_to_mesh_axes`` resolves them
  (a logical name listed twice is a fallback), or ``nn.Partitioned`` mesh axis
  names as they are. A dim its axis does not divide stays unsharded.

  The axes the rules place are compute axes, except the mesh axes listed in
  ``storage_only`` (one name or a tuple): MaxText-style rules
  ``[("embed", "fsdp"), ("mlp", "tensor")]`` with
  ``'logical_partitioning(storage_only="fsdp")'`` store params over both axes and
  gather ``fsdp`` for compute. The rules themselves stay flax's pairs, so the same
  ``config.sharding_rules`` place activations.
  """

  def rule(leaf: Leaf, spec: Spec):
    if leaf.names is None:
      return spec, "no axis names (not a boxed param)"
    if leaf.logical and not leaf.rules:
      return spec, (
          f"logical names {leaf.names} but no rules: pass rules=config.sharding_rules "
          "or plan inside `with nn.logical_axis_rules(rules):`"
      )
    mesh_axes = _resolve(leaf) if leaf.logical else tuple(leaf.names)
    notes = []
    for dim, axis in enumerate(mesh_axes):
      if axis is not None:
        spec, note = specs.place(leaf, spec, dim, axis)
        notes.append(note)
    return spec, "; ".join(notes) or f"names {leaf.names} map to no mesh axis"

  return rule


def _resolve(leaf: Leaf) -> tuple:
  try:
    return tuple(nn.logical_to_mesh_axes(leaf.names, leaf.rules))
  except ValueError as e:
    raise ShardingError(
        f"leaf {leaf.name!r}: logical names {leaf.names} do not resolve "
        f"with sharding_rules {list(leaf.rules)}: {e}"
    ) from None


def _too_small(leaf: Leaf, spec: Spec, threshold: float):
  note = specs.too_small(leaf, threshold)
  return (spec, note) if note else None


@register("preconditioner", follows=False)
def preconditioner(axis=None, dim=1):
  """Places preconditioner factors; acts on optimizer state only.

  On a factor of param dim ``i`` (Kron ``Q_i``: ``(d_i, d_i)``, ``(L, d_i, d_i)``), the
  param dim's axis (or ``axis`` when given; or, when dim ``i`` is not sharded, the
  param's first axis) goes on ``dim`` of the factor's square part (0: rows,
  1: columns). On any other state leaf (e.g. Shampoo block stacks
  ``(n_blocks, b, b)``), ``axis`` goes on leaf dim ``dim``.
  ``(".*Qs_preconditioners.*", 'preconditioner(dim=0)')`` puts factors on rows.
  """
  axis = None if axis is None else specs.check_axis("preconditioner", axis)
  if isinstance(dim, bool) or not isinstance(dim, int):
    raise ShardingError(f"preconditioner: dim must be an integer like 0 or 1, got {dim!r}")

  def rule(leaf: Leaf, spec: Spec):
    follow = leaf.follow
    if not leaf.state:
      return spec, "params are left as they are (preconditioner acts on state)"
    if follow is not None and follow.factor is not None:
      param_dim, lead = follow.factor
      param_axes = [a for a in follow.param_spec if a is not None]
      target = axis or follow.param_spec[param_dim] or (param_axes or [None])[0]
      if target is None:
        return spec, "the param is not sharded"
      return specs.place(leaf, spec, following.factor_dim_index(leaf.ndim, lead, dim), target)
    if axis is None:
      return spec, "not a preconditioner factor and no axis given"
    return specs.place(leaf, spec, dim, axis)

  return rule


@register("zero1", follows=False, storage_only=True)
def zero1(axis, min_size_to_shard_mb=1):
  """ZeRO-1: shards optimizer state over ``axis`` (largest free divisible dim), even
  where the params are replicated; params are left to other ops.

  ``[(".*", 'zero1(axis="data")')]`` keeps params replicated and shards state.
  """
  axis = specs.check_axis("zero1", axis)
  threshold = specs.check_number("zero1", "min_size_to_shard_mb", min_size_to_shard_mb)

  def rule(leaf: Leaf, spec: Spec):
    if not leaf.state:
      return spec, "params are left as they are (zero1 shards state)"
    return _too_small(leaf, spec, threshold) or specs.place_largest(leaf, spec, axis)

  return rule
