"""State placement declared by a transformation: a spec per leaf of its state's node types.

A transformation whose state is not placed well by following (:mod:`bv_sharding.following`:
same shape, factors, dims kept) declares where it keeps it: it registers the node type that
holds one param's state (a pytree class of its own, e.g. the block stacks of a Kron or
Shampoo preconditioner) with a function ``place(node, param_shape, param_spec, mesh_sizes)``
returning one spec (a ``PartitionSpec`` or tuple) per leaf of ``node``, in
``jax.tree.leaves(node)`` order. ``bvs.plan`` (and ``bvs.infer_sharding``) finds each such
node in the state, the param it belongs to by its path (as following does) and places the
node's leaves where ``place`` says, whatever strategy entry matches them: the plan is then
where the transformation runs its state. Keyed on the node's type, not on the transformation,
so a plain ``jax.eval_shape(tx.init, params)`` tree (big_vision's ``train.py``) is placed the
same. Every other state leaf is followed as before. A node that holds several params' state
together (an optimizer's pool of tiles kept where it runs) is registered ``per_param=False``:
``place(node, mesh_sizes)``, wherever it sits in the state. A node whose leaves each belong to
the param found on their own path (optax's ``FactoredState``: trees shaped like the params) is
registered ``per_param="leaves"``: ``place(node, params, mesh_sizes)``, ``params`` the node
with each leaf replaced by its param's :class:`ParamOf`, or ``None`` where none is found. A spec
of ``None`` in place of a leaf's declares nothing for it: that leaf is followed as any other.

Example:
  >>> import jax, jax.numpy as jnp
  >>> import bv_sharding as bvs
  >>> class Rows(tuple):  # One param's state: stacks of its rows.
  ...   pass
  >>> jax.tree_util.register_pytree_node(Rows, lambda r: (tuple(r), None), lambda _, c: Rows(c))
  >>> def place(node, param_shape, param_spec, mesh_sizes):
  ...   return [(param_spec[0], None) for _ in jax.tree.leaves(node)]  # rows where the param's are
  >>> bvs.ops.register_state(Rows, place)
  >>> tree = {"params": {"w": jax.ShapeDtypeStruct((64, 32), jnp.float32)},
  ...         "opt": {"w": Rows([jax.ShapeDtypeStruct((64, 64), jnp.float32)])}}
  >>> mesh = bvs.make_abstract_mesh([("data", 8)], 8)
  >>> entry = bvs.plan(tree, 'fsdp(axis="data", min_size_to_shard_mb=0)', mesh).by_name()["opt/w/0"]
  >>> entry.spec, entry.why
  (P('data', None), 'follows params/w (declared by Rows)')
"""

import dataclasses
from collections.abc import Callable

import jax

from bv_sharding.errors import ShardingError
from bv_sharding.specs import Spec, axes_of

_PLACERS: dict[type, Callable] = {}
_PER_PARAM: dict[type, bool | str] = {}
LEAVES = "leaves"


@dataclasses.dataclass(frozen=True)
class ParamOf:
  """A param as a ``per_param="leaves"`` placement sees it (not a pytree: a leaf)."""

  name: str
  shape: tuple[int, ...]
  spec: Spec


def register_state(node_type: type, place: Callable, per_param: bool | str = True) -> None:
  """Declares where ``node_type``'s leaves are kept: ``place(node, param_shape, param_spec,
  mesh_sizes) -> [spec per leaf of node]`` (module docstring). Registering a type again
  replaces its function.

  ``node_type`` must be a pytree node type (registered with ``jax.tree_util``), holding the
  state of one param, found below that param's path in the state tree; or, ``per_param``
  False, state of no one param: ``place(node, mesh_sizes)``; or, ``per_param="leaves"``,
  leaves of several params, each below its own param's path: ``place(node, params,
  mesh_sizes)`` (module docstring).
  """
  if per_param not in (True, False, LEAVES):
    raise ShardingError(f"register_state: per_param must be True, False or {LEAVES!r}")
  if not isinstance(node_type, type) or not callable(place):
    raise ShardingError(
        f"register_state({node_type!r}, {place!r}): expected a pytree node class and a "
        "function place(node, param_shape, param_spec, mesh_sizes) -> specs"
    )
  _PLACERS[node_type] = place
  _PER_PARAM[node_type] = per_param


def is_declared(x) -> bool:
  """Whether ``x`` is a node of a registered type."""
  return type(x) in _PLACERS


def declared_specs(tree, param_of: Callable, sizes: dict[str, int], name_of: Callable) -> dict:
  """``{leaf name: (spec, param name, why)}`` for the leaves of every registered node in
  ``tree`` whose param ``param_of(path components)`` finds (``(name, shape, spec)`` or None).

  ``name_of(key_path)``: a leaf's name, as the plan names leaves. A ``per_param=False``
  node's leaves have param name None.
  """
  found = {}
  nodes, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_declared)
  for path, node in nodes:
    if not is_declared(node):
      continue
    name, leaves = name_of(path), jax.tree_util.tree_flatten_with_path(node)[0]
    placed = _placed(node, name, [name_of(path + sub) for sub, _ in leaves], param_of, sizes)
    if placed is None:
      continue
    owners, specs = placed
    if len(specs) != len(leaves):
      raise ShardingError(
          f"{type(node).__name__}'s placement gave {len(specs)} specs for the {len(leaves)} "
          f"leaves of {name}; return one spec per leaf, in jax.tree.leaves order"
      )
    for (sub, leaf), owner, leaf_spec in zip(leaves, owners, specs):
      if leaf_spec is None:  # Left to following.
        continue
      leaf_spec = _checked(tuple(leaf_spec), leaf.shape, sizes, f"{name}: {type(node).__name__}")
      found[name_of(path + sub)] = (leaf_spec, owner, f"declared by {type(node).__name__}")
  return found


def _placed(node, name: str, leaf_names: list[str], param_of: Callable, sizes) -> tuple | None:
  """``(param name per leaf, spec per leaf)`` of ``node`` as its type declares; ``None`` for
  a ``per_param=True`` node whose param is not found.
  """
  kind, place, sizes = _PER_PARAM[type(node)], _PLACERS[type(node)], dict(sizes)
  if kind == LEAVES:
    found = [param_of(tuple(leaf.split("/"))) for leaf in leaf_names]
    params = [None if p is None else ParamOf(p[0], tuple(p[1]), tuple(p[2])) for p in found]
    tree = jax.tree_util.tree_unflatten(jax.tree.structure(node), params)
    return [p and p.name for p in params], list(place(node, tree, sizes))
  if not kind:
    return [None] * len(leaf_names), list(place(node, sizes))
  param = param_of(tuple(name.split("/")))
  if param is None:
    return None
  param_name, shape, spec = param
  return [param_name] * len(leaf_names), list(place(node, tuple(shape), tuple(spec), sizes))


def _checked(spec: Spec, shape, sizes: dict[str, int], where: str) -> Spec:
  """``spec`` padded to ``shape``'s rank, each dim divisible by the axes on it."""
  if len(spec) > len(shape):
    raise ShardingError(f"{where}: spec {spec} has more dims than the leaf's shape {shape}")
  spec = spec + (None,) * (len(shape) - len(spec))
  for dim, entry in zip(shape, spec):
    axes = axes_of(entry)
    n = 1
    for axis in axes:
      if axis not in sizes:
        raise ShardingError(f"{where}: spec {spec} names axis {axis!r}, not one of {list(sizes)}")
      n *= sizes[axis]
    if dim % n:
      raise ShardingError(f"{where}: spec {spec} splits a dim of {dim} {n} ways, for shape {shape}")
  return spec
