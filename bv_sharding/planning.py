"""Plans: a spec and a reason for every leaf of params and optimizer state, before any array exists.

Data flows one way: config strategy -> parsed ops -> :class:`Plan` (one
:class:`Entry` per leaf) -> ``NamedSharding`` trees for ``jax.jit``.

When the tree has a top-level ``params`` entry (dict key, attribute or field, as
in big_vision's ``{"params", "opt"}`` or flax's ``TrainState``), the leaves under
it are the params and every other leaf is state that follows them (see
:mod:`bv_sharding.following`); a tree without one is all params.

Example:
  >>> import jax
  >>> import optax
  >>> import bv_sharding as bvs
  >>> params = {"dense": {"kernel": jax.ShapeDtypeStruct((1024, 512), "float32")}}
  >>> opt = jax.eval_shape(optax.adam(1e-3).init, params)  # shapes only
  >>> mesh = bvs.make_abstract_mesh([("data", -1)], 256)  # a pod, planned from here
  >>> p = bvs.plan({"params": params, "opt": opt}, 'fsdp(axis="data", min_size_to_shard_mb=1)', mesh)
  >>> p.by_name()["params/dense/kernel"].spec
  P('data', None)
  >>> print(p.by_name()["opt/0/mu/dense/kernel"].why)
  follows params/dense/kernel (same shape); '.*' -> carried P('data', None)
"""

import dataclasses
import math
import numbers
import warnings
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

from bv_sharding import compute, declared, following, names, patterns, specs
from bv_sharding.errors import ShardingError, ShardingWarning
from bv_sharding.specs import Leaf, MiB, Spec

PARAMS = "params"
DEFAULT_MIN_SIZE_MB = 1
CONTEXT_RULES = "the rules of the enclosing nn.logical_axis_rules context"


@dataclasses.dataclass(frozen=True)
class Entry:
  """One leaf's decision: ``spec`` and ``why`` (which entry and op decided, or why not sharded).

  ``claimed_by``: the index in ``Plan.strategy`` of the entry whose regex claimed the
  leaf (``None``: no entry did). ``spec`` is the storage spec; ``compute_spec`` the spec
  the leaf's consumers need under Explicit axes: ``spec`` less the storage-only axes of
  the ops that placed it (``why`` ends with the axes gathered for compute), ``spec``
  itself for optimizer state (see :mod:`bv_sharding.compute`).
  """

  name: str
  shape: tuple[int, ...]
  dtype: Any
  spec: PartitionSpec
  why: str
  nbytes: int
  bytes_per_device: int
  follows: str | None = None
  claimed_by: int | None = None
  compute_spec: PartitionSpec | None = None

  def __post_init__(self):
    if self.compute_spec is None:  # Nothing gathered: computed on as stored.
      object.__setattr__(self, "compute_spec", self.spec)

  @property
  def sharded(self) -> bool:
    return any(axis is not None for axis in self.spec)


@dataclasses.dataclass(frozen=True)
class Plan:
  """Per-leaf specs for a tree on a mesh (a ``Mesh`` or an ``AbstractMesh``).

  ``strategy``: the ``(regex, op_chain)`` pairs it was planned with, as parsed; ``rules``:
  the ``(logical_name, mesh_axes)`` rules it resolved logical names with (the explicit
  ``rules=``, else the enclosing ``nn.logical_axis_rules``), as parsed.
  """

  entries: tuple[Entry, ...]
  treedef: Any
  mesh: Any
  strategy: tuple[tuple[str, str], ...] = ()
  rules: tuple = ()

  @property
  def specs(self):
    """``PartitionSpec`` tree with the input's structure (boxes unboxed, ``None`` kept)."""
    return self.treedef.unflatten([e.spec for e in self.entries])

  @property
  def shardings(self):
    """``NamedSharding`` tree for ``jax.jit(in_shardings=..., out_shardings=...)``."""
    return self.treedef.unflatten([NamedSharding(self.mesh, e.spec) for e in self.entries])

  @property
  def compute_specs(self):
    """``PartitionSpec`` tree of the leaves' compute specs (state: its storage spec)."""
    return self.treedef.unflatten([e.compute_spec for e in self.entries])

  @property
  def compute_shardings(self):
    """``NamedSharding`` tree of the compute specs: where params are used under Explicit axes.

    Example:
      >>> import bv_sharding as bvs, jax, numpy as np
      >>> mesh = jax.make_mesh((8,), ("data",))
      >>> p = bvs.plan({"w": jax.ShapeDtypeStruct((64, 8), np.float32)},
      ...              'fsdp(axis="data", min_size_to_shard_mb=0)', mesh)
      >>> p.shardings["w"].spec, p.compute_shardings["w"].spec
      (P('data', None), P(None, None))
    """
    return self.treedef.unflatten([NamedSharding(self.mesh, e.compute_spec) for e in self.entries])

  def abstract(self):
    """``jax.ShapeDtypeStruct`` tree carrying the planned ``NamedSharding``s: a restore target.

    Nothing is allocated; a checkpoint restored into it (e.g. orbax's
    ``StandardRestore(plan.abstract())``) lands in this plan's shardings, whatever
    mesh wrote it.

    Example:
      >>> import bv_sharding as bvs, jax, numpy as np
      >>> mesh = bvs.make_mesh([("data", -1)])
      >>> p = bvs.plan({"w": jax.ShapeDtypeStruct((8, 4), np.float32)}, "fsdp(axis='data')", mesh)
      >>> target = p.abstract()["w"]
      >>> target.shape, target.sharding == p.shardings["w"]
      ((8, 4), True)
    """
    return self.treedef.unflatten(
        [
            jax.ShapeDtypeStruct(e.shape, e.dtype, sharding=NamedSharding(self.mesh, e.spec))
            for e in self.entries
        ]
    )

  @property
  def total_bytes(self) -> int:
    return sum(e.nbytes for e in self.entries)

  @property
  def bytes_per_device(self) -> int:
    return sum(e.bytes_per_device for e in self.entries)

  @property
  def num_devices(self) -> int:
    return math.prod(self.mesh.shape.values())

  @property
  def axis_types(self) -> dict[str, str]:
    """``{axis: "auto" | "explicit" | "manual"}``: the types of the mesh planned on, which the
    specs hold for (:func:`plan`'s ``mesh``).

    Example:
      >>> from bv_sharding.mesh import make_abstract_mesh
      >>> mesh = make_abstract_mesh([("data", -1)], 8, axis_types="explicit")
      >>> plan({"w": jax.ShapeDtypeStruct((8,), "float32")}, "replicate()", mesh).axis_types
      {'data': 'explicit'}
    """
    return _axis_types(self.mesh)

  @property
  def coverage(self) -> float:
    """Bytes-weighted fraction of the ideal split achieved, in [0, 1].

    Each leaf counts its bytes times ``pieces / devices``: the pieces its spec cuts
    it into over the mesh's device count. A leaf split over every mesh axis counts
    fully, one split over ``data`` only on a ``data x model`` mesh counts
    ``data / (data * model)`` of its bytes, a replicated leaf nothing. ``1 - coverage``
    is the unsharded fraction ``bvs.check_coverage`` gates on.
    """
    split = sum(e.nbytes * self.pieces(e) for e in self.entries)
    return split / self.num_devices / max(self.total_bytes, 1)

  def by_name(self) -> dict[str, Entry]:
    return {e.name: e for e in self.entries}

  def pieces(self, entry: Entry) -> int:
    """How many pieces ``entry``'s spec cuts its leaf into on this plan's mesh."""
    return specs.shards(tuple(entry.spec), dict(self.mesh.shape))

  def unsharded_bytes(self, entry: Entry) -> float:
    """``entry``'s bytes times the share of the mesh its spec does not split it over: what the
    mesh could still take off each device."""
    return entry.nbytes * (1 - self.pieces(entry) / self.num_devices)

  def claims(self) -> tuple[list[tuple[str, str]], list[str]]:
    """``(entries of the strategy that claimed no leaf, leaves no entry claimed)``.

    An entry claims the leaves whose names its regex fullmatches first
    (``Entry.claimed_by``, recorded while planning; nothing is parsed again). An entry
    that claims nothing is almost always a typo; a state leaf no entry claims still
    follows its param (see :mod:`bv_sharding.following`).

    Example:
      >>> import bv_sharding as bvs, jax, warnings
      >>> tree = {"w": jax.ShapeDtypeStruct((64, 32), "float32"),
      ...         "b": jax.ShapeDtypeStruct((32,), "float32")}
      >>> strategy = [("w", 'fsdp(axis="data")'), ("bais", "replicate()")]
      >>> with warnings.catch_warnings(record=True) as caught:
      ...   warnings.simplefilter("always")
      ...   p = bvs.plan(tree, strategy, bvs.make_abstract_mesh([("data", 8)], 8))
      >>> print(caught[0].category.__name__, caught[0].message)
      ShardingWarning strategy entries ['bais'] match no leaf of the tree
      (2 leaves, e.g. ['b', 'w']); check the regexes against the names in plan.report()
      >>> p.claims()
      ([('bais', 'replicate()')], ['b'])
    """
    claimed = {e.claimed_by for e in self.entries}
    unused = [pair for i, pair in enumerate(self.strategy) if i not in claimed]
    return unused, [e.name for e in self.entries if e.claimed_by is None]

  def mismatches(self, tree) -> list[str]:
    """Names of arrays in ``tree`` whose sharding is not the planned one.

    A planned leaf missing from ``tree``, a leaf the plan lacks, a leaf that is not a
    ``jax.Array`` and one on a mesh whose axis types are not the plan's are listed too, as
    ``"name: why"``: a tree of another structure, or on a mesh of other types, never passes.
    """
    arrays, planned = dict(names.flatten(tree)[0]), self.by_name()
    wrong = [f"{name}: missing from the tree" for name in planned if name not in arrays]
    wrong += [f"{name}: not in the plan" for name in arrays if name not in planned]
    for name, x in arrays.items():
      if name not in planned:
        continue
      if not hasattr(x, "sharding"):
        wrong.append(f"{name}: a {type(x).__name__}, not a jax.Array")
      elif _axis_types(getattr(x.sharding, "mesh", self.mesh)) != self.axis_types:
        wrong.append(f"{name}: {_other_types(x.sharding.mesh, self.mesh)}")
      elif not x.sharding.is_equivalent_to(NamedSharding(self.mesh, planned[name].spec), x.ndim):
        wrong.append(name)
    return wrong

  def unsharded(self, min_bytes: int = 0) -> list[Entry]:
    """Unsharded entries of at least ``min_bytes``, largest first."""
    left = [e for e in self.entries if not e.sharded and e.nbytes >= min_bytes]
    return sorted(left, key=lambda e: -e.nbytes)

  def report(self, largest_unsharded: int = 5) -> str:
    """A readable table: one row per leaf, then :meth:`summary`."""
    rows = [("name", "shape", "dtype", "spec", "MiB/device", "why")]
    rows += [
        (
            e.name,
            str(e.shape),
            str(e.dtype),
            _spec_text(e.spec),
            f"{e.bytes_per_device / MiB:.3f}",
            e.why,
        )
        for e in self.entries
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r[:5], widths)) + "  " + r[5] for r in rows]
    return "\n".join([*lines, self.summary(largest_unsharded)])

  def summary(self, largest_unsharded: int = 5) -> str:
    """The totals (leaves, bytes, bytes per device against the ideal, coverage), then the
    ``largest_unsharded`` largest unsharded leaves: the report's last lines.

    Example:
      >>> from bv_sharding.mesh import make_abstract_mesh
      >>> tree = {"w": jax.ShapeDtypeStruct((4096, 512), "float32")}
      >>> print(plan(tree, 'fsdp(axis="data")', make_abstract_mesh([("data", -1)], 8)).summary())
      mesh {'data': 8}: 1 leaves, 8.00 MiB in all, 1.00 MiB per device (1.000x the ideal), coverage 100.0% of the 8-way split
    """
    ideal = self.total_bytes / self.num_devices
    lines = [
        f"mesh {dict(self.mesh.shape)}: {len(self.entries)} leaves, "
        f"{self.total_bytes / MiB:.2f} MiB in all, {self.bytes_per_device / MiB:.2f} MiB per "
        f"device ({self.bytes_per_device / max(ideal, 1):.3f}x the ideal), "
        f"coverage {100 * self.coverage:.1f}% of the {self.num_devices}-way split"
    ]
    for e in self.unsharded()[:largest_unsharded]:
      lines.append(f"  unsharded: {e.name} {e.shape} {e.nbytes / MiB:.3f} MiB: {e.why}")
    return "\n".join(lines)


def plan(
    tree,
    strategy,
    mesh,
    rules: Sequence | None = None,
    strict: bool = False,
    params: Plan | None = None,
) -> Plan:
  """Plans every leaf of ``tree`` (arrays, ``ShapeDtypeStruct``s or flax boxes).

  Args:
    tree: the pytree to plan; a top-level ``params`` entry makes the rest state that
      follows it (module docstring).
    strategy: ``[(regex, op_chain), ...]`` or one op chain string.
    mesh: a ``Mesh`` or an ``AbstractMesh``, its axes Auto, Explicit or mixed (e.g.
      ``jax.make_mesh``'s, Explicit by default). The types matter for one kind of state: a
      statistic its param broadcasts against (Adafactor's row and column statistics) that
      carries none of the param's axes is split on its own dim over Auto axes only (the
      fallback); under Explicit axes it stays as the update leaves it. Plan on a mesh of
      the types you run on (``Plan.axis_types`` records them).
    rules: ``config.sharding_rules`` for ``logical_partitioning()``. With ``None`` (or
      empty) a box's own ``rules``, else those of the enclosing
      ``with nn.logical_axis_rules(...)`` apply (as in flax and big_vision's train.py);
      explicit ``rules`` win over both.
    strict: an indivisible requested dim raises instead of staying unsharded, and so does
      a strategy entry whose regex matches no leaf (else a ``ShardingWarning``).
    params: the plan of ``{"params": ...}`` alone, made earlier with the same strategy,
      mesh and rules (e.g. to build an optimizer for the params' layout): its entries are
      the params' here, not decided again, and the state follows them.

  Returns:
    A :class:`Plan` with one :class:`Entry` per leaf, in ``tree``'s order.

  Raises:
    ShardingError: a strategy, rule or mesh mistake, named with its fix; ``params`` made
      with another strategy or mesh, or not of this tree's params; a leaf that is not an
      array (a string, a function); a tree nested deeper than ``names.MAX_DEPTH`` levels.

  Example:
    >>> import jax
    >>> from bv_sharding.mesh import make_abstract_mesh
    >>> tree = {"w": jax.ShapeDtypeStruct((512, 4096), "float32"),
    ...         "b": jax.ShapeDtypeStruct((1024,), "float32")}
    >>> p = plan(tree, 'fsdp(axis="data")', make_abstract_mesh([("data", -1)], 8))
    >>> [(e.name, e.spec, e.why) for e in p.entries]  # doctest: +NORMALIZE_WHITESPACE
    [('b', P(None,), "'.*' -> fsdp: 0.00391 MiB <= 4 MiB threshold"),
     ('w', P(None, 'data'), "'.*' -> fsdp: dim 1 over data; gathered for compute: data")]
  """
  sizes = _mesh_sizes(mesh)
  pats = patterns.parse_strategy(strategy, sizes)
  explicit = patterns.parse_rules(rules, sizes)
  context = (
      () if explicit else patterns.parse_rules(nn.get_logical_axis_rules(), sizes, CONTEXT_RULES)
  )
  named, treedef = names.flatten(tree)
  _check_matched(pats, [name for name, _ in named], strict)
  leaves = [_leaf(name, x, sizes, explicit, context, strict) for name, x in named]
  has_params = any(_is_param(leaf) for leaf in leaves)
  planned = {leaf.name: leaf for leaf in leaves if _is_param(leaf) or not has_params}
  pairs = tuple((p.regex, p.chain_text) for p in pats)
  decided = _earlier(params, planned, (pairs, explicit or context), mesh) or {
      name: _entry(leaf, sizes, *_decide_param(leaf, pats)) for name, leaf in planned.items()
  }
  by_path = {_relative(name): name for name in planned} if has_params else {}
  placed = _declared(tree, by_path, planned, decided, sizes) if has_params else {}
  entries, auto = [], frozenset(mesh.auto_axes)
  for leaf in leaves:
    if planned.get(leaf.name) is leaf:
      entries.append(decided[leaf.name])
    elif leaf.name in placed:
      entries.append(_declared_entry(leaf, placed[leaf.name], decided, pats, sizes))
    else:
      leaf = _with_follow(dataclasses.replace(leaf, state=True), by_path, planned, decided)
      entries.append(_entry(leaf, sizes, *_decide_state(leaf, pats, auto)))
  return Plan(tuple(entries), treedef, mesh, pairs, explicit or context)


def infer_sharding(tree, strategy, mesh, rules: Sequence | None = None, strict: bool = False):
  """``(shardings, specs)`` trees for ``tree``: the big_vision-style entry point.

  Example:
    >>> import jax
    >>> from bv_sharding.mesh import make_mesh
    >>> tree = {"w": jax.ShapeDtypeStruct((512, 4096), "float32")}
    >>> mesh = make_mesh([("data", -1)])
    >>> shardings, specs = infer_sharding(tree, [(".*", 'fsdp(axis="data")')], mesh)
    >>> specs
    {'w': P(None, 'data')}
    >>> w = jax.jit(lambda: jax.numpy.ones((512, 4096)), out_shardings=shardings["w"])()
    >>> w.sharding.spec
    P(None, 'data')
  """
  result = plan(tree, strategy, mesh, rules=rules, strict=strict)
  return result.shardings, result.specs


def _check_matched(pats, leaf_names: list[str], strict: bool) -> None:
  unused = patterns.unmatched(pats, leaf_names)
  if not unused:
    return
  message = (
      f"strategy entries {unused} match no leaf of the tree ({len(leaf_names)} leaves, e.g. "
      f"{leaf_names[:3]}); check the regexes against the names in plan.report()"
  )
  if strict:
    raise ShardingError(message)
  warnings.warn(message, ShardingWarning, stacklevel=3)


def _mesh_sizes(mesh) -> dict[str, int]:
  if not isinstance(mesh, (Mesh, AbstractMesh)):
    raise ShardingError(
        f"mesh must be a jax Mesh or AbstractMesh, got {type(mesh).__name__} {mesh!r}; build one "
        "from config.mesh with bvs.make_mesh(config.mesh) (or bvs.make_abstract_mesh(config.mesh, n))"
    )
  return dict(mesh.shape)


def _axis_types(mesh) -> dict[str, str]:
  return {a: t.name.lower() for a, t in zip(mesh.axis_names, mesh.axis_types)}


def _other_types(mesh, planned) -> str:
  """Why a plan made on mesh ``planned`` does not hold on ``mesh`` of other axis types."""
  return (
      f"a mesh with axis types {_axis_types(mesh)}, not the plan's {_axis_types(planned)} "
      "(specs of optimizer statistics depend on them); plan on a mesh of the types you run on, "
      'e.g. bvs.make_abstract_mesh(config.mesh, n, axis_types="explicit")'
  )


def _leaf(name, x, sizes, explicit, context, strict) -> Leaf:
  value = x.unbox() if names.is_box(x) else x
  if not hasattr(value, "shape") and not isinstance(value, (numbers.Number, np.generic)):
    raise ShardingError(
        f"leaf {name!r} is a {type(value).__name__} ({str(value)[:40]!r}), not an array: plan "
        "arrays, jax.ShapeDtypeStruct or flax boxes (jax.eval_shape gives the shapes)"
    )
  shape = tuple(getattr(value, "shape", np.shape(value)))
  dtype = value.dtype if hasattr(value, "dtype") else np.asarray(value).dtype
  box_names = tuple(x.names) if isinstance(x, nn.Partitioned) else None
  logical = isinstance(x, nn.LogicallyPartitioned)
  box_rules = explicit or tuple(getattr(x, "rules", None) or ()) or context
  return Leaf(name, shape, dtype, sizes, box_names, logical, box_rules, strict)


def _is_param(leaf: Leaf) -> bool:
  return leaf.components[0] == PARAMS


def _relative(name: str) -> tuple[str, ...]:
  return tuple(name.split("/"))[1:]


def _earlier(params: Plan | None, planned: dict, how: tuple, mesh) -> dict[str, Entry] | None:
  """``params``' entries by name, checked to be those of the ``planned`` leaves on ``mesh``
  under ``how``, this plan's ``(strategy pairs, rules)``; ``None`` without ``params``."""
  if params is None:
    return None
  earlier = params.by_name()
  (pairs, rules), same_rules = how, params.rules == how[1]
  if _axis_types(params.mesh) != _axis_types(mesh):
    raise ShardingError(f"params= was planned on {_other_types(params.mesh, mesh)}")
  if params.strategy != pairs or params.mesh != mesh or not same_rules:
    given = f"strategy {list(params.strategy)} on mesh {dict(params.mesh.shape)}"
    mine = f"{list(pairs)} on {dict(mesh.shape)}"
    if not same_rules:
      given, mine = f"{given} under rules {list(params.rules)}", f"{mine} under {list(rules)}"
    raise ShardingError(
        f"params= was planned with {given}, this plan uses {mine}; plan both with the same "
        "strategy, mesh and rules"
    )
  mine = {name: leaf.shape for name, leaf in planned.items()}
  if {e.name: tuple(e.shape) for e in params.entries} != mine:
    raise ShardingError(
        f"params= plans {len(earlier)} leaves, not this tree's {len(mine)} params with their "
        "names and shapes; pass the plan of {'params': ...} of these very params"
    )
  return earlier


def _with_follow(leaf: Leaf, by_path: dict, planned: dict, decided: dict) -> Leaf:
  name, rest = following.find_param(leaf.components, by_path)
  if name is None or leaf.ndim == 0:
    return leaf
  param, param_spec = planned[name], tuple(decided[name].spec)
  follow = following.relate(leaf.shape, rest, name, param.shape, param_spec, mesh_sizes=leaf.mesh)
  return dataclasses.replace(leaf, follow=follow)


def _declared(tree, by_path: dict, planned: dict, decided: dict, sizes) -> dict:
  """The specs the state's registered node types declare (:mod:`bv_sharding.declared`)."""

  def param_of(components):
    name, _ = following.find_param(components, by_path)
    return None if name is None else (name, planned[name].shape, tuple(decided[name].spec))

  return declared.declared_specs(tree, param_of, sizes, names.leaf_name)


def _declared_entry(leaf: Leaf, placed: tuple, decided: dict, pats, sizes) -> Entry:
  """A state leaf placed as its node type declares: its spec, following its param (if any)."""
  spec, param, how = placed
  if param is None:
    leaf = dataclasses.replace(leaf, state=True)
    return _entry(leaf, sizes, spec, how, _claim(pats, leaf.name))
  param_entry = decided[param]
  follow = following.Follow(param, param_entry.shape, tuple(param_entry.spec), how, spec)
  leaf = dataclasses.replace(leaf, state=True, follow=follow)
  return _entry(leaf, sizes, spec, f"follows {param} ({how})", _claim(pats, leaf.name))


def _claim(pats, name: str) -> int | None:
  """The index of the first pattern whose regex fullmatches ``name``; ``None``: none does."""
  return next((i for i, p in enumerate(pats) if patterns.fullmatch(p, name)), None)


def _decide_param(leaf: Leaf, pats) -> tuple[Spec, str, int | None, PartitionSpec | None]:
  """A param's storage spec, why, claiming entry and compute spec (less the storage-only axes)."""
  claimed = _claim(pats, leaf.name)
  if claimed is None:
    return _replicated(leaf), "no strategy entry matches: replicated", None, None
  pattern = pats[claimed]
  spec, notes, gathered = _apply_chain(pattern.ops, leaf)
  why = f"{pattern.regex!r} -> {notes}{compute.gather_note(gathered)}"
  return spec, why, claimed, compute.without(spec, gathered)


def _decide_state(leaf: Leaf, pats, auto_axes=frozenset()) -> tuple[Spec, str, int | None]:
  """A state leaf's spec, why and claiming entry; ``auto_axes``: the mesh's Auto axes, the only
  ones the fallback gives a statistic its param broadcasts against (:func:`_fallback_axes`)."""
  claimed = _claim(pats, leaf.name)
  pattern = None if claimed is None else pats[claimed]
  follow = leaf.follow
  if follow is None:
    if leaf.ndim == 0:
      return _replicated(leaf), "scalar state: replicated", claimed
    if pattern is None:
      return _replicated(leaf), "no param to follow, no strategy entry: replicated", claimed
    spec, notes, _ = _apply_chain(pattern.ops, leaf)
    return spec, f"no param to follow; {pattern.regex!r} -> {notes}", claimed
  ops = pattern.ops if pattern else ()
  follow_param = not ops or any(op.follows for op in ops)
  spec, notes, _ = _apply_chain(ops, leaf, follow_param, auto_axes)
  where = f"{pattern.regex!r} -> " if pattern else "default: "
  return spec, f"follows {follow.param} ({follow.how}); {where}{notes}", claimed


def _apply_chain(
    ops, leaf: Leaf, follow_param: bool = False, auto_axes=frozenset()
) -> tuple[Spec, str, set[str]]:
  """Applies a chain of ops to one leaf; returns its spec, the notes joined and the
  storage-only axes of the spec (as the ops that placed them declare).

  On a state leaf that follows a param, the chain's first sharding op
  (``follows=True``) places the param's spec instead of acting, and later ones are
  skipped. With ``follow_param`` (the chain is empty or has a sharding op), an empty
  chain places the param's spec too, and a big leaf left unsharded goes to the
  size-based fallback; a statistic its param broadcasts against (``Follow.broadcasts``)
  there takes only ``auto_axes`` (:func:`_fallback_axes`).
  """
  spec, notes, param_spec_placed, storage = _replicated(leaf), [], False, set()
  for op in ops:
    if leaf.follow is not None and op.follows:
      if not param_spec_placed:
        spec, note = _place_param_spec(leaf, spec)
        notes.append(note)
        param_spec_placed = True
      continue
    before = spec
    spec, note = specs.checked(op.name, op.rule(leaf, spec), leaf)
    notes.append(f"{op.name}: {note}")
    # Axes the op kept keep their kind, those it added take its kind, those it cleared go.
    storage = storage & specs.used_axes(spec) | compute.storage_axes(op.storage_only, before, spec)
  if follow_param and not ops:
    spec, note = _place_param_spec(leaf, spec)
    notes.append(note)
  if follow_param and not any(spec):
    threshold = _threshold(ops)
    if leaf.nbytes >= threshold * MiB:
      spec, note = _fallback(leaf, spec, _fallback_axes(leaf, ops, auto_axes))
      notes.append(f"fallback (>= {threshold:g} MiB): {note}")
  return spec, "; ".join(notes) or "replicated", storage


def _place_param_spec(leaf: Leaf, spec: Spec) -> tuple[Spec, str]:
  """Puts the axes of the followed param's spec (as related by ``leaf.follow``) on ``spec``."""
  follow = leaf.follow
  if follow.spec is None:
    return spec, "no dims in common"
  for dim, axis in enumerate(follow.spec):
    if axis is not None:
      spec, _ = specs.place(leaf, spec, dim, axis, requested=False)
  return spec, f"carried {_spec_text(PartitionSpec(*spec))}"


def _fallback(leaf: Leaf, spec: Spec, candidates) -> tuple[Spec, str]:
  """Size-based rule: the block-batch dim 0 of a 3+-d stack first (over all the candidate
  axes together when they divide it), else the largest divisible dim."""
  note = (
      "no mesh axis to use" if candidates else "no Auto axis (a broadcast statistic keeps its own)"
  )
  if leaf.ndim >= 3 and len(candidates) > 1:
    new, note = specs.place(leaf, spec, 0, tuple(candidates), requested=False)
    if new != spec:
      return new, note
  for axis in candidates:
    if leaf.ndim >= 3:
      new, note = specs.place(leaf, spec, 0, axis, requested=False)
      if new != spec:
        return new, note
    new, note = specs.place_largest(dataclasses.replace(leaf, strict=False), spec, axis)
    if new != spec:
      return new, note
  return spec, note


def _fallback_axes(leaf: Leaf, ops, auto_axes) -> list:
  """Axes for the fallback: the chain's ``axis`` arguments, else the param's, else the mesh's.

  A statistic its param broadcasts against (``Follow.broadcasts``: Adafactor's row and
  column statistics, a diagonal factor) takes only the mesh's ``auto_axes``. Under Explicit
  axes the update gives it the sharding of a mean over the param's dims it drops: only the
  param's axes on the dims it keeps (:mod:`bv_sharding.following`), so an axis of its own
  would change the update's sharding. Under Auto axes the compiler reshards it (a gather of
  the statistic, smaller than the param's shard), and the plan keeps it split like the rest.
  """
  from_ops = [op.arguments["axis"] for op in ops if op.follows and "axis" in op.arguments]
  from_param = [a for a in leaf.follow.param_spec if a is not None]
  axes = from_ops or from_param or list(leaf.mesh)
  if not leaf.follow.broadcasts:
    return axes
  return [a for a in axes if set(specs.axes_of(a)) <= auto_axes]


def _threshold(ops) -> float:
  sizes = [
      op.arguments["min_size_to_shard_mb"] for op in ops if "min_size_to_shard_mb" in op.arguments
  ]
  return sizes[0] if sizes else DEFAULT_MIN_SIZE_MB


def _replicated(leaf: Leaf) -> Spec:
  return (None,) * leaf.ndim


def _entry(
    leaf: Leaf,
    sizes,
    spec: Spec,
    why: str,
    claimed: int | None,
    compute_spec: PartitionSpec | None = None,
) -> Entry:
  per_device = leaf.nbytes // specs.shards(spec, sizes)
  follows = leaf.follow.param if leaf.follow is not None else None
  return Entry(
      leaf.name,
      leaf.shape,
      leaf.dtype,
      PartitionSpec(*spec),
      why,
      leaf.nbytes,
      per_device,
      follows,
      claimed,
      compute_spec,
  )


def _spec_text(spec: PartitionSpec) -> str:
  return "P(" + ", ".join(repr(a) if a is not None else "None" for a in spec) + ")"
