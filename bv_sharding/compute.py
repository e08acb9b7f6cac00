"""Compute specs: the layout a param's consumers need, next to the layout it is stored in.

Under Explicit mesh axes (``jax.make_mesh``'s default) an array's sharding is part of
its type, and an op whose operands disagree raises ``ShardingTypeError`` instead of
inserting collectives. FSDP then means "store sharded, gather for compute": a param's
*compute spec* is its storage spec less the axes that exist only to save memory (those
placed by ops registered ``storage_only``: ``fsdp``, ``llm_fsdp``, ``zero1``), while
tensor-parallel axes stay. Optimizer state is never gathered: its compute spec is its
storage spec. Under Auto axes the compiler places everything and nothing here is needed.

Example:
  >>> import jax
  >>> import bv_sharding as bvs
  >>> mesh = bvs.make_abstract_mesh([("data", 4), ("model", 2)], 8, axis_types="explicit")
  >>> tree = {"mlp": {"up_kernel": jax.ShapeDtypeStruct((1024, 4096), "float32")}}
  >>> e = bvs.plan(tree, 'tensor_parallel(axis="model")|fsdp(axis="data")', mesh).entries[0]
  >>> e.spec, e.compute_spec
  (P('data', 'model'), P(None, 'model'))
"""

import jax
from jax.sharding import NamedSharding, PartitionSpec

from bv_sharding import names, specs
from bv_sharding.errors import ShardingError
from bv_sharding.specs import Spec

PARAMS = "params"


def storage_axes(storage_only: bool | tuple[str, ...], before: Spec, after: Spec) -> set[str]:
  """The axes an op added (``before`` -> ``after``) that only save memory, by its declaration.

  Example:
    >>> sorted(storage_axes(True, (None, "model"), ("data", "model")))
    ['data']
    >>> storage_axes(("fsdp",), (None,), ("tensor",))
    set()
  """
  added = specs.used_axes(after) - specs.used_axes(before)
  if isinstance(storage_only, bool):
    return added if storage_only else set()
  return added & set(storage_only)


def without(spec, axes) -> PartitionSpec:
  """``spec`` with ``axes`` removed from every dim (a dim left with none is replicated).

  Example:
    >>> without(PartitionSpec(("data", "model"), None), {"data"})
    P('model', None)
  """
  kept = []
  for entry in spec:
    left = tuple(a for a in specs.axes_of(entry) if a not in axes)
    kept.append(None if not left else left[0] if len(left) == 1 else left)
  return PartitionSpec(*kept)


def save_anything_but_gathers(prim, *avals, **params) -> bool:
  """A ``jax.checkpoint`` policy: save every value but a gather's result (a ``reshard`` that
  drops mesh axes), so the backward pass gathers again instead of keeping what the forward
  pass gathered: FSDP's "gather, use, drop" in both passes, as ZeRO-3 does.

  Around a scanned layer that gathers its params (``gather_for_compute(...,
  stacked=...)``), only the gathers are recomputed and no layer's gathered params are
  saved for the backward pass; everything else is saved as without the policy.

  Example:
    >>> import jax, numpy as np
    >>> from jax.ad_checkpoint import print_saved_residuals
    >>> import bv_sharding as bvs
    >>> mesh = jax.make_mesh((8,), ("data",))
    >>> w = jax.device_put(np.ones((64, 64), np.float32), jax.NamedSharding(mesh, jax.P("data")))
    >>> def layer(x, w):  # gathers w, then uses it
    ...   return jax.numpy.tanh(x @ jax.sharding.reshard(w, jax.P()))
    >>> f = jax.checkpoint(layer, policy=bvs.save_anything_but_gathers)
    >>> with jax.set_mesh(mesh):
    ...   print_saved_residuals(f, np.ones((8, 64), np.float32), w)
    f32[8,64] from the argument x
    f32[64@data,64] from the argument w
    f32[8,64] output of tanh ...(layer)
    f32[8,64] output of sub ...(layer)
  """
  if prim.name != "reshard":
    return True
  stored, target = avals[0].sharding.spec, params["dst_sharding"].spec
  return not specs.used_axes(tuple(stored)) - specs.used_axes(tuple(target))


def gather_note(axes) -> str:
  """The ``why`` note for a param whose compute spec gathers ``axes`` ("" when none)."""
  return f"; gathered for compute: {', '.join(sorted(axes))}" if axes else ""


def gather_for_compute(params, plan, *, stacked: str | None = None):
  """``params`` resharded from their storage specs to their compute specs, for use inside jit.

  Call it inside the loss, where the params are used: ``jax.sharding.reshard``'s
  transpose brings the gradients back to the storage specs, so ``jax.grad`` of the loss
  returns gradients laid out as the params (and the optimizer state) are stored. Only the
  mesh's Explicit axes are resharded; Auto axes stay the compiler's to place, so on an
  Auto mesh the params come back as they are.

  Gathering the whole tree at once holds every gathered param at the same time; for a
  scanned stack of layers that is the whole stack. With ``stacked``, ``params`` is one
  layer's slice of the stack at that path of the plan, and each leaf is gathered to its
  entry's compute spec less the stacked (leading) dim: called inside the scanned body
  (e.g. through ``flax.linen.map_variables``), it gathers one layer at a time.

  Args:
    params: the plan's tree, or its ``params`` part (as ``model.apply`` takes it); with
      ``stacked``, one slice of that stack.
    plan: a :class:`bv_sharding.Plan` of the params (alone or with the optimizer state).
    stacked: the path in the plan of a stack whose slice ``params`` is, e.g.
      ``"params/layers"``.

  Raises:
    ShardingError: a leaf of ``params`` the plan does not have.

  Example:
    >>> import jax, numpy as np
    >>> import bv_sharding as bvs
    >>> mesh = jax.make_mesh((8,), ("data",))  # Explicit axes
    >>> tree = {"params": {"w": jax.ShapeDtypeStruct((64, 32), np.float32)}}
    >>> p = bvs.plan(tree, 'fsdp(axis="data", min_size_to_shard_mb=0)', mesh)
    >>> params = jax.jit(lambda: {"w": jax.numpy.ones((64, 32))},
    ...                  out_shardings=p.shardings["params"])()
    >>> jax.typeof(params["w"])
    ShapedArray(float32[64@data,32])
    >>> def loss(params):
    ...   w = bvs.gather_for_compute(params, p)["w"]
    ...   print(jax.typeof(w))  # at trace time: gathered
    ...   return (w**2).sum()
    >>> grads = jax.jit(jax.grad(loss))(params)
    float32[64,32]
    >>> grads["w"].sharding.spec  # back to the storage spec
    P('data', None)
    >>> stack = {"params": {"layers": {"w": jax.ShapeDtypeStruct((3, 64, 32), np.float32)}}}
    >>> s = bvs.plan(stack, 'fsdp(axis="data", min_size_to_shard_mb=0)', mesh)
    >>> @jax.jit
    ... def layer_gathered(layer):  # one layer's slice of the stack, stored split over data
    ...   return bvs.gather_for_compute({"w": layer}, s, stacked="params/layers")["w"]
    >>> layer = jax.device_put(np.ones((64, 32), np.float32), jax.NamedSharding(mesh, jax.P("data")))
    >>> layer_gathered(layer).sharding.spec
    P(None, None)
  """
  named, treedef = names.flatten(params)
  entries = plan.by_name()
  if stacked is not None:
    prefix = stacked.rstrip("/") + "/"
  else:
    prefix = "" if all(name in entries for name, _ in named) else PARAMS + "/"
  explicit = set(plan.mesh.explicit_axes)
  gathered = []
  for name, x in named:
    entry = entries.get(prefix + name)
    if entry is None:
      raise ShardingError(
          f"gather_for_compute: leaf {prefix + name!r} is not in the plan (its leaves are "
          f"e.g. {list(entries)[:3]}); pass the params the plan was made for, their "
          f"{PARAMS!r} part, or a slice of the stack named by stacked="
      )
    spec = entry.compute_spec if stacked is None else PartitionSpec(*tuple(entry.compute_spec)[1:])
    target = without(spec, set(plan.mesh.axis_names) - explicit)
    gathered.append(jax.sharding.reshard(x, NamedSharding(plan.mesh, target)) if explicit else x)
  return treedef.unflatten(gathered)
