"""Optimizer state saved by one run and restored by another: kept, reordered or re-initialised.

The optimizer a run built (:class:`BuiltOptimizer`) leaves a record in each of its
checkpoints: ``config.optax_name`` and the params' layout its blocks were cut under
(:meth:`BuiltOptimizer.record`, JSON). A run restoring that checkpoint asks
:func:`migrate_state` what to do with the saved state:

* same optimizer, same layout (or none recorded): the saved state as it is;
* same optimizer on another layout: Kron's and Shampoo's block stacks reordered to
  this layout's order when the blocks are the same tiles (each factor still
  preconditions its own block), else re-initialised;
* another optimizer, or a state tree that differs: re-initialised.

Re-initialising is the caller's (it knows where the state lives); the answer says why.

Example:
  >>> import jax.numpy as jnp
  >>> params = {"w": jax.ShapeDtypeStruct((4, 2), jnp.float32)}
  >>> adam = BuiltOptimizer("adam", params)
  >>> meta = {"step": 8, **adam.record()}  # A checkpoint's meta.
  >>> migrate_state(meta, adam, None, load=lambda: "the saved state")
  ('the saved state', "adam's, as saved")
  >>> migrate_state(meta, BuiltOptimizer("lion", params), "opt/0/nu is missing", load=None)
  (None, "config.optax_name changed from 'adam' to 'lion'")
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import optax

from trainers.errors import OptimizerError
from trainers.optimizers import rebirth
from trainers.optimizers.layout import ParamLayout, reorder, stack_blocks, stack_moves

RECORD = "optimizer"  # The key of the record in a checkpoint's meta.


@dataclasses.dataclass(frozen=True)
class BuiltOptimizer:
  """The optimizer a run built, as its state's migration sees it.

  ``name``: ``config.optax_name``; ``params``: the abstract params (``ShapeDtypeStruct``s);
  ``layout``: the :class:`~trainers.optimizers.ParamLayout` its blocks are cut under
  (None: none is recorded and saved block stacks are never moved); ``optimizer_for``
  (given with a layout): the same optimizer built for another layout, so the blocks a
  saving run stacked are known.
  """

  name: str
  params: Any
  layout: ParamLayout | None = None
  optimizer_for: Callable[[ParamLayout], optax.GradientTransformation] | None = None

  def record(self) -> dict:
    """What a checkpoint stores in its meta, JSON-able; :func:`migrate_state` reads it back.

    Example:
        >>> BuiltOptimizer("adamw", {}).record()
        {'optimizer': {'name': 'adamw', 'layout': None}}
    """
    layout = None if self.layout is None else self.layout.record()
    return {RECORD: {"name": self.name, "layout": layout}}

  def migrate(self, saved_meta: dict, mismatch: str | None, load: Callable[[], Any]) -> tuple:
    """:func:`migrate_state` of this run's optimizer."""
    return migrate_state(saved_meta, self, mismatch, load)

  def reborn(self, state, step: int, saved_meta: dict, saved_table: dict, read) -> tuple:
    """:func:`~trainers.optimizers.rebirth.reborn` of this run's state, born at ``step``."""
    return rebirth.reborn(
        state, step, (saved_record(saved_meta)["name"], saved_table), self.name, read
    )


def migrate_state(
    saved_meta: dict, built: BuiltOptimizer, mismatch: str | None, load: Callable[[], Any]
) -> tuple[Any | None, str]:
  """``(state, reason)``: the saved optimizer state for ``built`` (None: re-initialise it), and why.

  ``saved_meta``: the checkpoint's meta, holding the saving run's :meth:`~BuiltOptimizer.record`
  (or, written before that record existed, its ``optax_name`` and ``layout`` keys);
  ``mismatch``: None when the saved state's tree (names, shapes, dtypes) is the one
  ``built`` has, else its first difference, described; ``load``: reads the saved state
  in this run's shardings, called only when the state is kept. The reason completes
  "optimizer state re-initialised (...)" or "... with its optimizer state (...)".
  """
  saved = saved_record(saved_meta)
  if saved["name"] != built.name:
    return None, f"config.optax_name changed from {saved['name']!r} to {built.name!r}"
  moves, stacks = None, 0
  if built.layout is not None and saved["layout"] is not None:
    try:
      moves, stacks = block_moves(saved["layout"], built)
    except OptimizerError as e:
      return None, f"its blocks differ on this mesh: {e}"
  if mismatch:
    return None, f"its state differs: {mismatch}"
  if moves is None:
    return load(), f"{built.name}'s, as saved"
  return reorder_stacks(load(), moves), (
      f"{built.name}'s, saved on mesh {dict(saved['layout']['mesh'])}, restored on mesh "
      f"{dict(built.layout.record()['mesh'])}: every factor, statistic and moment carried over, "
      f"{sum(m is not None for m in moves)} of {stacks} block stacks reordered; same tiles, so "
      "each factor still preconditions its own block"
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


def block_moves(saved_layout: dict, built: BuiltOptimizer) -> tuple[list | None, int]:
  """``(moves, stacks)``: per optimizer state leaf, how its block stack moves from the saving
  run's layout to ``built.layout`` (:func:`~trainers.optimizers.layout.stack_moves`; None:
  it stays), and how many leaves are block stacks now. ``moves`` is None when the layouts
  are equal.

  ``saved_layout``: a :meth:`~trainers.optimizers.ParamLayout.record`. Raises
  ``OptimizerError`` naming the first stack whose blocks are not the same tiles.
  """
  now = built.layout.record()
  if saved_layout == now:
    return None, 0
  stacks = []
  for record in (saved_layout, now):
    tx = built.optimizer_for(ParamLayout.from_record(record, built.params))
    state = jax.eval_shape(tx.init, built.params)
    stacks.append(stack_blocks(tx, built.params, state))
  paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(state)[0]]
  names = [f"opt/{jax.tree_util.keystr(p, simple=True, separator='/')}" for p in paths]
  return stack_moves(*stacks, names), sum(b is not None for b in stacks[1])


def reorder_stacks(state, moves: list):
  """``state`` with each moved block stack (``moves``: per leaf, from :func:`block_moves`) in
  its new order, in the shardings it has.

  Example:
      >>> import jax.numpy as jnp
      >>> from jax.sharding import PartitionSpec as P
      >>> from trainers.optimizers.layout import shard_blocks
      >>> on = lambda n: shard_blocks((4, 4), P(None, "data"),
      ...     jax.sharding.AbstractMesh((n,), ("data",)), 2)
      >>> stack = on(2).split(jnp.arange(16.0).reshape(4, 4))
      >>> moved = reorder_stacks([stack, jnp.zeros(1)], [(on(2), on(1)), None])
      >>> [float(b[0, 0]) for b in moved[0]]
      [0.0, 2.0, 8.0, 10.0]
  """
  leaves, treedef = jax.tree.flatten(state)
  moved = [
      x
      if move is None
      else jax.jit(lambda x, move=move: reorder(x, *move), out_shardings=x.sharding)(x)
      for x, move in zip(leaves, moves, strict=True)
  ]
  return treedef.unflatten(moved)
