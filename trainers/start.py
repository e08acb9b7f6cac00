"""Where a run starts: its newest checkpoint, else ``config.model_init``, else a fresh init.

The run-start policy, in the order :func:`restore_or_init` tries it:

* the newest checkpoint of the workdir that checks out (``trainers/rundir/checkpoint.py``
  reads and verifies it, and moves a damaged step aside): params and step always, the
  optimizer state as the run's optimizer says (:class:`Migration`: kept, moved, or born
  afresh at the saved step with the leaves that mean the same carried over, the rebirth of
  bv_sharding/optimizers/rebirth.py), each logged in one line;
* else the params of ``config.model_init`` (a workdir, its ``checkpoints/`` or one step),
  with a fresh optimizer state and step 0;
* else a fresh init, born sharded from the plan.

Whichever it is, the state lands in the plan's shardings and is checked against it. The
trainer's use (it needs the workdir's checkpoints, so it is shown, not run here)::

  ckpt = checkpoint.Checkpoints(workdir, config, run.migration, run.plan)
  state, begun = restore_or_init(ckpt, run)   # begun.step: steps done; begun.source

Example:
  >>> Start(0, "scratch")
  Start(step=0, source='scratch', opt_start=0)
  >>> reborn_note(8, "ckpt/8", "another optimizer", {"mu": "mu"}, ["nu"]).split("; ")[1:]
  ['carried over: opt/mu -> opt/mu', 'born afresh: opt/nu']
"""

import dataclasses
from collections.abc import Callable
from typing import Protocol

import optax
from absl import logging

from bv_sharding import Plan
from bv_sharding.optimizers import unramped, with_ramp
from trainers import steps
from trainers.rundir import checkpoint
from trainers.rundir.checkpoint import OPT, PARAMS
from trainers.stored import StoredForm


class Migration(Protocol):
  """The run's optimizer, as a resume needs it (the optimizer package's ``BuiltOptimizer``).

  ``record()``: JSON-able entries each checkpoint's ``meta`` carries for it.
  ``migrate(saved_meta, differs, load)``: ``(state, reason)``, the saved optimizer state
  for this run (None: re-initialise it) and why, in words. ``saved_meta``: the
  checkpoint's meta; ``differs(tree=None)``: None when the saved state's leaves are
  ``tree``'s (default: the state this run builds), else the first differing leaf
  (:func:`checkpoint.first_difference`); ``load(targets=None)``: the saved state read onto
  ``targets`` (default: the plan's shardings; read only if kept).
  ``reborn(state, step, saved_meta, saved_table, read)``: ``(state, carried, renewed)``, a
  state just born at ``step`` continuing the schedule there, with the saved leaves it carries
  over (``{new leaf: saved leaf}``; ``read({saved leaf: target})`` reads them) and the
  names of the leaves it leaves as born (each param path written ``*``).
  """

  def record(self) -> dict:
    ...

  def migrate(self, saved_meta: dict, differs: Callable, load: Callable) -> tuple:
    ...

  def reborn(self, state, step: int, saved_meta: dict, saved_table: dict, read) -> tuple:
    ...


@dataclasses.dataclass(frozen=True)
class Start:
  """Where a run starts: ``step`` done so far, ``source`` (a path or "scratch"), ``opt_start``.

  ``opt_start`` is the step the optimizer state was born at: its schedule counts global
  steps (the logged learning rate is ``lr(step - 1)``), its ``config.rewarmup_steps`` ramp
  the steps since ``opt_start``.
  """

  step: int
  source: str
  opt_start: int = 0


def restore_or_init(ckpt: checkpoint.Checkpoints, run) -> tuple[dict, Start]:
  """``(state, Start)``: the newest checkpoint of ``ckpt`` that checks out, else
  ``config.model_init``'s params, else a fresh init; in ``run``'s plan, checked.

  ``run``: a ``trainers.build.Run`` (its config, plan, optimizer, migration and init). A
  checkpoint of another model raises ``CheckpointMismatchError`` naming the first differing
  leaf; one that does not check out is moved aside and the previous one tried. ``ckpt``
  learns the step and the optimizer's birth step its next checkpoints record.
  """
  logging.info("initialising params and optimizer state in their planned shardings")
  plan, tx, config = run.plan, run.tx, run.config
  read = lambda manager, step: restore(manager, step, plan, tx, run.migration, form=run.stored)
  restored = ckpt.newest_good(read)
  if restored is not None:
    state, begun = restored
  elif config.model_init:
    state, begun = from_model_init(config.model_init, plan, tx)
  else:
    state, begun = steps.init_state(run.init, tx, plan), Start(0, "scratch")
  ckpt.begin(begun.step, begun.opt_start)
  when = "after init" if begun.source == "scratch" else "after restore"
  steps.check_state(plan, state, when)
  logging.info("state shardings match the plan %s", when)
  return state, begun


def from_model_init(path: str, plan: Plan, tx: optax.GradientTransformation) -> tuple:
  """``(state, Start)``: the params of the checkpoint at ``path`` (``config.model_init``:
  :func:`checkpoint.load_params`) with a fresh optimizer state, at step 0."""
  params, source = checkpoint.load_params(path, plan)
  logging.info(
      "params from config.model_init=%s: %s; optimizer state and step start fresh", path, source
  )
  return {"params": params, "opt": steps.init_opt(tx, plan, params)}, Start(0, source)


def restore(
    manager,
    step: int,
    plan: Plan,
    tx: optax.GradientTransformation,
    migration: Migration,
    verify: bool = True,
    form: StoredForm | None = None,
) -> tuple[dict, Start]:
  """``(state, Start)`` from checkpoint ``step`` of ``manager`` (an orbax ``CheckpointManager``,
  ``checkpoint.open_manager``) in ``plan``'s shardings; the optimizer state as ``migration``
  says (kept, moved, or born afresh from ``tx`` with what carries over), logged in one line.

  Saved floating-point arrays in another dtype (``config.param_dtype``,
  ``config.state_dtype``) are cast to the plan's as they are read, logged in one line too.
  Every array is checked against its checksum (``checkpoint.restore_item``; ``verify=False``:
  not). The items' metadata is read once. ``form``: the form the state was saved in
  (:class:`trainers.stored.StoredForm`; the state is read in it and held as the run holds it
  after), None: as the run holds it.
  """
  meta = checkpoint.read_meta(manager, step)
  saved_params, saved_opt = checkpoint.saved_tables(manager, step)
  param_casts = checkpoint.check_params(manager, step, plan, saved_params)
  target = (plan if form is None else form.plan).abstract()
  held = (lambda state: state) if form is None else form.from_stored

  def differs(tree=None):
    table = checkpoint.leaf_table(target[OPT] if tree is None else tree)
    mismatch = checkpoint.first_difference(table, saved_opt)
    return mismatch and f"{OPT}/{mismatch}"

  load = lambda targets=None: checkpoint.restore_item(
      manager, step, OPT, target[OPT] if targets is None else targets, meta, saved_opt, verify
  )
  opt, why = migration.migrate(meta, *before_ramp(target[OPT], differs, load))
  params = checkpoint.restore_item(
      manager, step, PARAMS, target[PARAMS], meta, saved_params, verify
  )
  source = str(manager.directory / str(step))
  opt_casts = {}
  if opt is not None:
    opt_casts = checkpoint.casts(checkpoint.leaf_table(target[OPT]), saved_opt)
  if note := checkpoint.cast_note({"params": param_casts, "opt state": opt_casts}):
    logging.info("%s", note)
  if opt is not None:
    logging.info("resumed at step %d from %s with its optimizer state (%s)", step, source, why)
    return held({"params": params, "opt": opt}), Start(step, source, meta["opt_start"])
  read = lambda targets: checkpoint.restore_leaves(manager, step, OPT, targets, meta, verify)
  born = {"params": params, "opt": steps.init_opt(tx, plan, params)}
  born = born if form is None else form.to_stored(born)
  opt, carried, renewed = migration.reborn(born["opt"], step, meta, saved_opt, read)
  logging.info("%s", reborn_note(step, source, why, carried, renewed))
  return held({"params": params, "opt": opt}), Start(step, source, step)


def before_ramp(target, differs: Callable, load: Callable) -> tuple[Callable, Callable]:
  """``(differs, load)`` as :meth:`Migration.migrate` takes them, for a checkpoint that this
  run's optimizer wrote before its chain ended with a ramp (``bv_sharding.optimizers.ramped``): where the saved
  state is ``target``'s without its ramp, it is read as that and the ramp appended saturated
  (the run continues as it was); else ``differs`` and ``load`` as they are.

  Example:
    >>> import jax.numpy as jnp
    >>> from bv_sharding.optimizers import RampState
    >>> target = ("adam's", RampState(jnp.int32(0)))  # Its state and its ramp.
    >>> differs = lambda tree=None: None if len(tree or ()) == 1 else "opt/1/count"
    >>> _, load = before_ramp(target, differs, lambda targets=None: targets)
    >>> load()[0], int(load()[1].count)
    ("adam's", 2147483647)
  """
  inner = unramped(target)
  if inner is None or not differs() or differs(inner):
    return differs, load
  return (
      lambda tree=None: differs(inner if tree is None else unramped(tree) or tree),
      lambda targets=None: with_ramp(load(inner if targets is None else unramped(targets)), target),
  )


def reborn_note(step: int, source: str, why: str, carried: dict, renewed) -> str:
  """The log line of a resume whose optimizer state was born afresh at ``step``: why, and the
  saved leaves ``carried`` over (``{new: saved}``) and those ``renewed`` (born as they are).

  Example: ``reborn_note(8, "ckpt/8", "another optimizer", {}, [])`` ends "born afresh: nothing".
  """
  moved = ", ".join(f"opt/{saved} -> opt/{new}" for new, saved in carried.items())
  fresh = ", ".join(f"opt/{name}" for name in renewed)
  return (
      f"resumed at step {step} from {source} with params and step only: optimizer state "
      f"re-initialised ({why}), the new state born sharded from the plan, its schedule at step "
      f"{step}; carried over: {moved or 'nothing'}; born afresh: {fresh or 'nothing'}"
  )
