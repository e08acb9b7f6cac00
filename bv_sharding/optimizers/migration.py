"""Optimizer state saved by one run and restored by another: kept, reordered or re-initialised.

The optimizer a run built (:class:`BuiltOptimizer`) leaves a record in each of its
checkpoints: ``config.optax_name`` and the params' layout its blocks were cut under
(:meth:`BuiltOptimizer.record`, JSON). A run restoring that checkpoint asks
:func:`migrate_state` what to do with the saved state:

* same optimizer, same layout (or none recorded): the saved state as it is;
* same optimizer on another layout: the state read as the saving layout made it, and
  Kron's and Shampoo's block stacks moved to this layout's order and pools
  (:func:`restack`) when the blocks are the same tiles (each factor still
  preconditions its own block), else re-initialised;
* another optimizer, or a state tree that differs: re-initialised.

Re-initialising is the caller's (it knows where the state lives); the answer says why.

Example:
  >>> import jax.numpy as jnp
  >>> params = {"w": jax.ShapeDtypeStruct((4, 2), jnp.float32)}
  >>> adam = BuiltOptimizer("adam", params)
  >>> meta = {"step": 8, **adam.record()}  # A checkpoint's meta.
  >>> same = lambda tree=None: None  # The saved leaves are the state's.
  >>> migrate_state(meta, adam, same, load=lambda targets=None: "the saved state")
  ('the saved state', "adam's, as saved")
  >>> migrate_state(meta, BuiltOptimizer("lion", params), same, load=None)
  (None, "config.optax_name changed from 'adam' to 'lion'")
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from bv_sharding.errors import OptimizerError
from bv_sharding.optimizers import rebirth
from bv_sharding.optimizers.layout import (
    ParamLayout,
    padded,
    reorder,
    same_blocking,
    spread_sharding,
    stack_runs,
    tiles_text,
)

RECORD = "optimizer"  # The key of the record in a checkpoint's meta.
# Options that decide where an optimizer's block stacks are stored, not what they hold.
STORAGE_OPTIONS = ("pool_padding",)


@dataclasses.dataclass(frozen=True)
class BuiltOptimizer:
  """The optimizer a run built, as its state's migration sees it.

  ``name``: ``config.optax_name``; ``params``: the abstract params (``ShapeDtypeStruct``s);
  ``layout``: the :class:`~bv_sharding.optimizers.ParamLayout` its blocks are cut under
  (None: none is recorded and saved block stacks are never moved); ``optimizer_for``
  (given with a layout): the same optimizer built for another layout, so the blocks a
  saving run stacked are known, called ``optimizer_for(layout, storage)``; ``state``: its
  abstract state in the run's shardings (None: unsharded), where a restore onto another
  layout puts the moved stacks; ``storage``: its :data:`STORAGE_OPTIONS` that are set
  (e.g. ``{"pool_padding": 1.0}``), recorded, so that a restore under other ones moves the
  stacks as for another layout; ``learning_rate``: the schedule it applies (``step -> lr``),
  for a state born mid-run (:func:`~bv_sharding.optimizers.rebirth.at_step`); ``decays``: those
  of its state's EMAs and heavy-ball sums by field (``registry.state_decays``), recorded, so
  that a state born mid-run from its checkpoints reads each moment in its units and this
  one's heavy-ball sums are born full (:func:`~bv_sharding.optimizers.rebirth.reborn`).
  """

  name: str
  params: Any
  layout: ParamLayout | None = None
  optimizer_for: Callable[[ParamLayout, dict], optax.GradientTransformation] | None = None
  state: Any = None
  storage: dict = dataclasses.field(default_factory=dict)
  learning_rate: Callable | None = None
  decays: dict = dataclasses.field(default_factory=dict)

  def record(self) -> dict:
    """What a checkpoint stores in its meta, JSON-able; :func:`migrate_state` reads it back.

    Example:
        >>> BuiltOptimizer("adamw", {}).record()
        {'optimizer': {'name': 'adamw', 'layout': None}}
    """
    layout = None if self.layout is None else self.layout.record()
    storage = {"storage": self.storage} if self.storage else {}
    decays = {"decays": self.decays} if self.decays else {}
    return {RECORD: {"name": self.name, "layout": layout, **storage, **decays}}

  def migrate(self, saved_meta: dict, differs: Callable, load: Callable) -> tuple:
    """:func:`migrate_state` of this run's optimizer."""
    return migrate_state(saved_meta, self, differs, load)

  def reborn(self, state, step: int, saved_meta: dict, saved_table: dict, read) -> tuple:
    """:func:`~bv_sharding.optimizers.rebirth.reborn` of this run's state, born at ``step``: what
    is carried is decided from the state tables, the saved moments read with the decays
    ``saved_meta``'s record gives (none in a checkpoint written before they were recorded)."""
    decays = (self.decays, saved_record(saved_meta).get("decays", {}))
    return rebirth.reborn(state, step, saved_table, read, self.params, self.learning_rate, decays)


def migrate_state(
    saved_meta: dict, built: BuiltOptimizer, differs: Callable, load: Callable
) -> tuple[Any | None, str]:
  """``(state, reason)``: the saved optimizer state for ``built`` (None: re-initialise it), and why.

  ``saved_meta``: the checkpoint's meta, holding the saving run's :meth:`~BuiltOptimizer.record`
  (or, written before that record existed, its ``optax_name`` and ``layout`` keys);
  ``differs(tree=None)``: None when the saved state's leaves (names, shapes, dtypes) are
  ``tree``'s (default: the state ``built`` has), else their first difference, described;
  ``load(targets=None)``: reads the saved state onto ``targets`` (abstract arrays; default:
  this run's shardings), called only when the state is kept. Saved on another layout, the
  state is read as that layout made it and its block stacks moved to this layout's
  (:func:`restack`). The reason completes "optimizer state re-initialised (...)" or "...
  with its optimizer state (...)".
  """
  saved = saved_record(saved_meta)
  if saved["name"] != built.name:
    return None, f"config.optax_name changed from {saved['name']!r} to {built.name!r}"
  storage = saved.get("storage", {})
  laid = built.layout is not None and saved["layout"] is not None
  if not laid or (saved["layout"], storage) == (built.layout.record(), built.storage):
    if mismatch := differs():
      return None, f"its state differs: {mismatch}"
    return load(), f"{built.name}'s, as saved"
  try:
    states, runs = stacks_between(saved["layout"], storage, built)
  except OptimizerError as e:
    return None, f"its blocks differ on this mesh: {e}"
  if mismatch := differs(states[0]):
    return None, f"its state differs: {mismatch}"
  state, moves = restack(load(saved_targets(states[0], built.state)), states, built.state, runs)
  stored = lambda options: f" under {options}" if storage != built.storage else ""
  return state, (
      f"{built.name}'s, saved on mesh {dict(saved['layout']['mesh'])}{stored(storage)}, restored "
      f"on mesh {dict(built.layout.record()['mesh'])}{stored(built.storage)}: every factor, "
      f"statistic and moment carried over, {moves} of {len(runs[1])} block stacks reordered or "
      "repooled; same tiles, so each factor still preconditions its own block"
  )


def saved_record(saved_meta: dict) -> dict:
  """The saving run's record (``name``, ``layout``) from a checkpoint's meta, old or new.

  Example:
      >>> saved_record({"step": 4, "optax_name": "kron", "opt_start": 0})
      {'name': 'kron', 'layout': None}
  """
  if RECORD in saved_meta:
    return saved_meta[RECORD]
  return {"name": saved_meta["optax_name"], "layout": saved_meta.get("layout")}


def stacks_between(saved_layout: dict, storage: dict, built: BuiltOptimizer) -> tuple[tuple, tuple]:
  """``((saved_state, state), (saved_runs, runs))``: the abstract states the saving run's
  layout and ``storage`` options and ``built``'s make, and both runs'
  :func:`~bv_sharding.optimizers.layout.stack_runs`.

  ``saved_layout``: a :meth:`~bv_sharding.optimizers.ParamLayout.record`. Raises
  ``OptimizerError`` naming the first stack whose blocks are not the same tiles.
  """
  states, runs = [], []
  for record, options in ((saved_layout, storage), (built.layout.record(), built.storage)):
    tx = built.optimizer_for(ParamLayout.from_record(record, built.params), options)
    states.append(jax.eval_shape(tx.init, built.params))
    runs.append(stack_runs(tx, built.params, states[-1]))
  names = _names(states[1])
  for old, new in zip(*runs, strict=True):
    if not same_blocking(old.blocks, new.blocks):
      name = names[new.leaves[0]] if new.leaves else "a block stack"
      raise OptimizerError(f"{name}: {tiles_text(old.blocks)} before, {tiles_text(new.blocks)} now")
  return tuple(states), tuple(runs)


def _names(state) -> list[str]:
  paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(state)[0]]
  return [f"opt/{jax.tree_util.keystr(p, simple=True, separator='/')}" for p in paths]


def saved_targets(saved_state, targets):
  """Where to read the saved state: each leaf this run has alike (name, shape) in its
  sharding, the others (block stacks of the saving layout) spread over this run's mesh.

  ``targets``: this run's abstract state in its shardings, or None (no shardings).
  """
  if targets is None:
    return saved_state
  here = dict(zip(_names(targets), jax.tree.leaves(targets)))
  mesh = jax.tree.leaves(targets)[0].sharding.mesh
  leaves, treedef = jax.tree.flatten(saved_state)
  placed = []
  for name, x in zip(_names(saved_state), leaves):
    same = here.get(name)
    if same is not None and same.shape == x.shape:
      placed.append(same)
    else:
      placed.append(jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=spread_sharding(x.shape, mesh)))
  return treedef.unflatten(placed)


def restack(saved, states: tuple, targets, runs: tuple) -> tuple[Any, int]:
  """``(state, moves)``: ``saved`` (arrays of the saved state's tree) as this run's state, in
  ``targets``' shardings (None: unsharded): each block stack in this layout's order and
  pools, the other leaves by name; ``moves``: the stacks that changed.

  Example: ``restack(load(saved_targets(states[0], built.state)), states, built.state, runs)``
  with :func:`stacks_between`'s ``states, runs``.
  """
  saved_state, target = states
  names, old_names = _names(target), _names(saved_state)
  lengths = [x.shape[0] if x.shape else 0 for x in jax.tree.leaves(target)]
  changed = [old.blocks != new.blocks or old.offset != new.offset for old, new in zip(*runs)]

  def convert(old_leaves):
    by_name = dict(zip(old_names, old_leaves))
    new = [by_name.get(name) for name in names]
    pools: dict[tuple, list] = {}
    for old, run in zip(*runs):
      parts = [old_leaves[i] for i in old.leaves]
      if old.offset is not None:
        parts = [x[old.offset : old.offset + old.blocks.count] for x in parts]
      if old.blocks != run.blocks:
        parts = [reorder(x, old.blocks, run.blocks) for x in parts]
      if run.offset is None:
        for i, x in zip(run.leaves, parts):
          new[i] = x
      else:
        pools.setdefault(run.leaves, []).append((run.offset, parts))
    for leaves, members in pools.items():
      joined = zip(*(parts for _, parts in sorted(members, key=lambda m: m[0])))
      for i, xs in zip(leaves, joined):
        new[i] = padded(jnp.concatenate(xs), lengths[i])
    return jax.tree.structure(target).unflatten(new)

  shardings = None if targets is None else jax.tree.map(lambda x: x.sharding, targets)
  return jax.jit(convert, out_shardings=shardings)(jax.tree.leaves(saved)), sum(changed)
