"""Logical axis names of the models' activations, and how activations are constrained to them.

Each tuple names the dims of one activation; ``config.sharding_rules`` maps the names to
mesh axes. :func:`constrain` (and :func:`matmul`, for a product whose output layout is
ambiguous) applies the rules: ``nn.with_logical_constraint`` on an Auto mesh,
``jax.sharding.reshard`` over the Explicit axes of an Explicit mesh (where
``with_sharding_constraint`` only asserts). Outside an ``nn.logical_axis_rules`` context
they leave activations as they are. ``ACT_BATCH`` is also the rule the trainer splits its
batches by (``trainers.steps.data_axes``).

Example:
  >>> import flax.linen as nn
  >>> with nn.logical_axis_rules([("act_batch", "data"), ("act_heads", "model")]):
  ...   nn.logical_to_mesh_axes(ACT_HEADS)
  P('data', None, 'model', None)
"""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

import bv_sharding as bvs

ACT_BATCH = "act_batch"
ACT_EMBED = (ACT_BATCH, "act_len", "act_embed")  # The token stream: (batch, length, width).
ACT_HEADS = (ACT_BATCH, "act_len", "act_heads", None)  # (batch, length, heads, head_dim).
ACT_MLP = (ACT_BATCH, "act_len", "act_mlp")  # The MLP's hidden units.
ACT_VOCAB = (ACT_BATCH, "act_len", "act_vocab")  # Logits.
ACTIVATION_NAMES = frozenset(n for t in (ACT_EMBED, ACT_HEADS, ACT_MLP, ACT_VOCAB) for n in t if n)
LAYERS = "layers"  # The leading dim of scanned layers' params (``config.model.scan_layers``).


def unused_rules(rules, params) -> list[str]:
  """The logical names of ``rules`` (``(name, mesh axes)`` pairs) that no activation of the
  models (:data:`ACTIVATION_NAMES`), no scanned layer axis (:data:`LAYERS`) and no param of
  ``params`` (its flax boxes' names) has: legal, but most likely a misspelt name, which then
  shards nothing.

  Example:
    >>> params = {"w": nn.LogicallyPartitioned(jnp.zeros((2, 2)), ("embed", "mlp"))}
    >>> unused_rules([("act_batch", "data"), ("mlp", "model"), ("mlpp", "model")], params)
    ['mlpp']
  """
  boxes = jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, nn.Partitioned))
  names = {n for b in boxes if isinstance(b, nn.Partitioned) for n in b.names if n}
  return [name for name, _ in rules if name not in names | ACTIVATION_NAMES | {LAYERS}]


def explicit_spec(names, shape) -> PartitionSpec | None:
  """The spec the rules give ``names`` over the current mesh's Explicit axes, for an array of
  ``shape``; ``None`` where nothing is Explicit or no rules are set.

  A dim whose mesh axes do not divide it stays whole (e.g. init's one-row example).

  Example:
    >>> import flax.linen as nn
    >>> import bv_sharding as bvs
    >>> mesh = bvs.make_mesh([("data", -1)], axis_types="explicit")  # 8 devices
    >>> with jax.set_mesh(mesh), nn.logical_axis_rules([("act_batch", "data")]):
    ...   explicit_spec(ACT_EMBED, (16, 4, 8)), explicit_spec(ACT_EMBED, (1, 4, 8))
    (P('data', None, None), P(None, None, None))
  """
  mesh = jax.sharding.get_abstract_mesh()
  explicit = set(() if mesh.empty else mesh.explicit_axes)
  if not explicit or not nn.get_logical_axis_rules():
    return None
  dims = []
  for size, entry in zip(shape, nn.logical_to_mesh_axes(names)):
    axes = tuple(a for a in ((entry,) if isinstance(entry, str) else entry or ()) if a in explicit)
    fits = axes and size % math.prod(mesh.shape[a] for a in axes) == 0
    dims.append((axes[0] if len(axes) == 1 else axes) if fits else None)
  return PartitionSpec(*dims)


def constrain(x: jax.Array, names) -> jax.Array:
  """``x`` laid out as the rules map the logical ``names`` (module docstring).

  Example:
    >>> constrain(jnp.ones((2, 3, 4)), ACT_EMBED).shape  # no rules set: unchanged
    (2, 3, 4)
  """
  spec = explicit_spec(names, x.shape)
  return nn.with_logical_constraint(x, names) if spec is None else jax.sharding.reshard(x, spec)


def matmul(x: jax.Array, kernel: jax.Array, names) -> jax.Array:
  """``x @ kernel`` laid out as ``names``: on Explicit axes the product is told its output
  sharding, which a kernel split along the summed dim (row-parallel) leaves ambiguous.

  A kernel split along its output dim over axes the rules keep that dim of the output whole
  on (a tensor-parallel ``lm_head`` when the rules do not split the vocabulary) is gathered
  over those axes first: moving the kernel costs less than moving the output it would split
  whenever there are more rows (tokens) than the kernel has input dims, as XLA's Auto
  partitioning also decides.

  Example:
    >>> matmul(jnp.ones((2, 3, 4)), jnp.ones((4, 5)), ACT_EMBED).shape
    (2, 3, 5)
  """
  spec = explicit_spec(names, (*x.shape[:-1], kernel.shape[-1]))
  if spec is None:
    return nn.with_logical_constraint(x @ kernel, names)
  return jnp.matmul(x, _output_dim_as(kernel, spec[-1]), out_sharding=spec)


def _output_dim_as(kernel: jax.Array, entry) -> jax.Array:
  """``kernel`` with its last dim split over no axes but those of ``entry``, the output's."""
  stored = jax.typeof(kernel).sharding.spec
  dims = list(stored) + [None] * (kernel.ndim - len(stored))
  last = tuple(bvs.ops.axes_of(dims[-1]))
  kept = tuple(a for a in last if a in set(bvs.ops.axes_of(entry)))
  if kept == last:
    return kernel
  dims[-1] = (kept[0] if len(kept) == 1 else kept) if kept else None
  return jax.sharding.reshard(kernel, PartitionSpec(*dims))


def take(table: jax.Array, ids: jax.Array, names) -> jax.Array:
  """Rows ``ids`` of ``table`` (an embedding lookup) laid out as ``names``: on Explicit axes the
  gather is told its output sharding, which ids split over the batch leave ambiguous.

  Example:
    >>> take(jnp.eye(4), jnp.array([[3, 0]]), ACT_EMBED)
    Array([[[0., 0., 0., 1.],
            [1., 0., 0., 0.]]], dtype=float32)
  """
  spec = explicit_spec(names, (*ids.shape, *table.shape[1:]))
  if spec is None:
    return nn.with_logical_constraint(jnp.take(table, ids, axis=0), names)
  return table.at[ids].get(out_sharding=spec)
