"""What extending the library needs, in one place: writing an op, and planning an optimizer.

An op is a factory registered by name (:func:`bv_sharding.register`, or
:func:`bv_sharding.temporary_ops` for one ``with`` block). Its arguments come from
the config string; it returns a rule ``rule(leaf, spec) -> (spec, note)`` that sees
a :class:`Leaf` (name, shape, dtype, mesh axis sizes) and the spec so far (one
entry per dim: ``None``, an axis name or a tuple of names, see :func:`axes_of` and
:func:`axis_size`), and adds axes only through :func:`place` (one dim) or
:func:`place_largest` (the largest free dim an axis divides). Both refuse what
``jax.jit`` would reject and say why in the note, so ops compose in chains. An op
whose axes only save memory (FSDP-like) is registered ``storage_only=True``, so that
under Explicit axes params are gathered over them for compute; by default an op's axes
are compute axes and stay (see :func:`bv_sharding.register`).

An optimizer whose state the plan places agrees with it on leaf names
(:func:`flatten_with_names`, the names strategy regexes match). Its state is followed to its
params (same shape, factors, dims kept; :mod:`bv_sharding.following`), or, where the
optimizer keeps it otherwise, placed as it declares: :func:`register_state` registers the
pytree node type holding one param's state with a function giving each of its leaves' spec
from the param's shape and spec and the mesh's axis sizes, and ``bvs.plan`` (so
``bvs.infer_sharding``) places every such node's leaves there
(:mod:`bv_sharding.declared`; the library's Kron and Shampoo declare their block stacks so).

Example:
  >>> import jax
  >>> import bv_sharding as bvs
  >>> from bv_sharding import ops
  >>> def shard_rows(axis):
  ...   def rule(leaf: ops.Leaf, spec: ops.Spec):
  ...     return ops.place(leaf, spec, -2, axis) if leaf.ndim >= 2 else (spec, "a vector")
  ...   return rule
  >>> mesh = bvs.make_abstract_mesh([("data", -1)], 8)
  >>> tree = {"w": jax.ShapeDtypeStruct((64, 32), "float32")}
  >>> with bvs.temporary_ops(shard_rows=shard_rows):
  ...   print(bvs.plan(tree, 'shard_rows(axis="data")', mesh).by_name()["w"].why)
  '.*' -> shard_rows: dim 0 over data
"""

from bv_sharding.aliases import deprecated as _deprecated
from bv_sharding.declared import register_state
from bv_sharding.following import stack_axes
from bv_sharding.names import flatten as flatten_with_names
from bv_sharding.specs import (
    Leaf,
    Spec,
    axes_of,
    axis_size,
    check_axis,
    check_number,
    place,
    place_largest,
    too_small,
)

__all__ = [
    "Leaf",
    "Spec",
    "axes_of",
    "axis_size",
    "check_axis",
    "check_number",
    "flatten_with_names",
    "place",
    "place_largest",
    "register_state",
    "stack_axes",
    "too_small",
]

# Registration is exported once, at the top: ``bvs.register``, ``bvs.temporary_ops``.
__getattr__ = _deprecated(
    {name: f"bv_sharding.{name}" for name in ("register", "registered", "temporary_ops")},
    __name__,
)
