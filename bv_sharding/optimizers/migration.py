"""Optimizer state saved by one run and restored by another: kept or re-initialised.

The optimizer a run built (:class:`BuiltOptimizer`) leaves a record in each of its
checkpoints: ``config.optax_name`` and the params' layout its blocks were cut under
(:meth:`BuiltOptimizer.record`, JSON). A run restoring that checkpoint asks
:func:`migrate_state` what to do with the saved state:

* same optimizer, same layout (or none recorded): the saved state as it is;
* same optimizer on another layout: the saved state as it is when its blocks are the same
  tiles (``blocking="tiles"``, the default: Kron's and Shampoo's state is the same on any
  mesh, each stack in the order of its blocks' places in the param,
  :mod:`bv_sharding.optimizers.placement`), else re-initialised (``blocking="local"`` cuts
  other blocks on another mesh: its factors would precondition other blocks);
* another optimizer, or a state tree that differs: re-initialised.

Re-initialising is the caller's (it knows where the state lives); the answer says why.

Example:
  >>> import jax, jax.numpy as jnp
  >>> params = {"w": jax.ShapeDtypeStruct((4, 2), jnp.float32)}
  >>> adam = BuiltOptimizer("adam", params)
  >>> meta = {"step": 8, **adam.record()}  # A checkpoint's meta.
  >>> same = lambda tree=None: None  # The saved leaves are the state's.
  >>> migrate_state(meta, adam, same, load=lambda: "the saved state")
  ('the saved state', "adam's, as saved")
  >>> migrate_state(meta, BuiltOptimizer("lion", params), same, load=None)
  (None, "config.optax_name changed from 'adam' to 'lion'")
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from bv_sharding.errors import OptimizerError
from bv_sharding.optimizers import rebirth
from bv_sharding.optimizers.layout import ParamLayout
from bv_sharding.optimizers.placement import check_same_tiles

RECORD = "optimizer"  # The key of the record in a checkpoint's meta.


@dataclasses.dataclass(frozen=True)
class BuiltOptimizer:
  """The optimizer a run built, as its state's migration sees it.

  ``name``: ``config.optax_name``; ``params``: the abstract params (``ShapeDtypeStruct``s);
  ``layout``: the :class:`~bv_sharding.optimizers.ParamLayout` its blocks are cut under
  (None: none is recorded, and a saved state is kept whatever mesh saved it); ``state``: its
  abstract state (None: it has no block stacks to check), whose
  :class:`~bv_sharding.optimizers.placement.Stacks` say how each param is cut;
  ``learning_rate``: the schedule it applies (``step -> lr``), for a state born mid-run
  (:func:`~bv_sharding.optimizers.rebirth.at_step`); ``decays``: those of its state's EMAs
  and heavy-ball sums by field (``registry.state_decays``), recorded, so that a state born
  mid-run from its checkpoints reads each moment in its units and this one's heavy-ball sums
  are born full (:func:`~bv_sharding.optimizers.rebirth.reborn`).
  """

  name: str
  params: Any
  layout: ParamLayout | None = None
  state: Any = None
  learning_rate: Callable | None = None
  decays: dict = dataclasses.field(default_factory=dict)

  def record(self) -> dict:
    """What a checkpoint stores in its meta, JSON-able; :func:`migrate_state` reads it back.

    Example:
        >>> BuiltOptimizer("adamw", {}).record()
        {'optimizer': {'name': 'adamw', 'layout': None}}
    """
    layout = None if self.layout is None else self.layout.record()
    decays = {"decays": self.decays} if self.decays else {}
    return {RECORD: {"name": self.name, "layout": layout, **decays}}

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
  ``differs()``: None when the saved state's leaves (names, shapes, dtypes) are those of the
  state ``built`` has, else their first difference, described; ``load()``: reads the saved
  state onto this run's shardings, called only when the state is kept. The reason completes
  "optimizer state re-initialised (...)" or "... with its optimizer state (...)".
  """
  saved = saved_record(saved_meta)
  if saved["name"] != built.name:
    return None, f"config.optax_name changed from {saved['name']!r} to {built.name!r}"
  moved = built.layout is not None and saved["layout"] not in (None, built.layout.record())
  if moved and built.state is not None:
    try:
      saved_layout = ParamLayout.from_record(saved["layout"], built.params)
      check_same_tiles(built.state, built.params, saved_layout, built.layout)
    except OptimizerError as e:
      return None, f"its blocks differ on this mesh: {e}"
  if mismatch := differs():
    return None, f"its state differs: {mismatch}"
  if not moved:
    return load(), f"{built.name}'s, as saved"
  return load(), (
      f"{built.name}'s, saved on mesh {dict(saved['layout']['mesh'])}, restored on mesh "
      f"{dict(built.layout.record()['mesh'])} as saved: every factor, statistic and moment "
      "carried over, the same tiles, each stored at its block's place on any mesh"
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
