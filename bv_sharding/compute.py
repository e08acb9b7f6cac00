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


def gather_note(axes) -> str:
  """The ``why`` note for a param whose compute spec gathers ``axes`` ("" when none)."""
  return f"; gathered for compute: {', '.join(sorted(axes))}" if axes else ""


def gather_for_compute(params, plan):
  """``params`` resharded from their storage specs to their compute specs, for use inside jit.

  Call it inside the loss, where the params are used: ``jax.sharding.reshard``'s
  transpose brings the gradients back to the storage specs, so ``jax.grad`` of the loss
  returns gradients laid out as the params (and the optimizer state) are stored. Only the
  mesh's Explicit axes are resharded; Auto axes stay the compiler's to place, so on an
  Auto mesh the params come back as they are.

  Gathering the whole tree at once holds every gathered param at the same time; for a
  scanned stack of layers that is the whole stack. The memory-friendly alternative is to
  gather inside the model, one layer at a time (e.g. ``reshard`` on each layer's slice of
  the stack inside the scanned body, with that layer's ``plan.compute_specs``), so only one
  layer is ever gathered.

  Args:
    params: the plan's tree, or its ``params`` part (as ``model.apply`` takes it).
    plan: a :class:`bv_sharding.Plan` of the params (alone or with the optimizer state).

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
  """
  named, treedef = names.flatten(params)
  entries = plan.by_name()
  prefix = "" if all(name in entries for name, _ in named) else PARAMS + "/"
  explicit = set(plan.mesh.explicit_axes)
  gathered = []
  for name, x in named:
    entry = entries.get(prefix + name)
    if entry is None:
      raise ShardingError(
          f"gather_for_compute: leaf {name!r} is not in the plan (its leaves are e.g. "
          f"{list(entries)[:3]}); pass the params the plan was made for, or their "
          f"{PARAMS!r} part"
      )
    target = without(entry.compute_spec, set(plan.mesh.axis_names) - explicit)
    gathered.append(jax.sharding.reshard(x, NamedSharding(plan.mesh, target)) if explicit else x)
  return treedef.unflatten(gathered)
