"""What writing a sharding op needs, in one place.

An op is a factory registered by name (:func:`register`, or :func:`temporary_ops`
for one ``with`` block). Its arguments come from the config string; it returns a
rule ``rule(leaf, spec) -> (spec, note)`` that sees a :class:`Leaf` (name, shape,
dtype, mesh axis sizes) and the spec so far (one entry per dim: ``None``, an axis
name or a tuple of names), and adds axes only through :func:`place` (one dim) or
:func:`place_largest` (the largest free dim an axis divides). Both refuse what
``jax.jit`` would reject and say why in the note, so ops compose in chains.

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
  >>> with ops.temporary_ops(shard_rows=shard_rows):
  ...   print(bvs.plan(tree, 'shard_rows(axis="data")', mesh).by_name()["w"].why)
  '.*' -> shard_rows: dim 0 over data
"""

from bv_sharding.registry import register, registered, temporary_ops
from bv_sharding.specs import Leaf, Spec, check_axis, check_number, place, place_largest, too_small

__all__ = [
    "Leaf",
    "Spec",
    "check_axis",
    "check_number",
    "place",
    "place_largest",
    "register",
    "registered",
    "temporary_ops",
    "too_small",
]
