"""Durable runs: orbax checkpoints restored onto the current plan, resume, preemption.

A checkpoint (``workdir/checkpoints/<step>/``) holds three orbax items: ``params``,
``opt`` (the optimizer state) and ``meta`` (step, optimizer name, the step the
optimizer state was born at, the params' layout). Data and RNG are pure functions of (seed, step),
so the step is all the rest of the run needs to continue exactly.

Restoring never reads the saved shardings: the target is ``plan.abstract()``, the
current config's plan, so a checkpoint moves between meshes and process counts.
Optimizer state is restored only when ``config.optax_name`` and its tree (names,
shapes, dtypes) are unchanged; otherwise the new optimizer's state is born
sharded from the plan and its count (hence its schedule) starts at 0. Kron's and
Shampoo's block stacks saved on another layout are reordered to this one's when
the tiles are the same, else the state is re-initialised (:func:`block_moves`).

The training loop's use (``Checkpoints`` installs a SIGTERM handler, so it is shown,
not run here)::

  ckpt = Checkpoints(workdir, config)
  state, start = ckpt.restore_or_init(plan, tx, fresh=lambda: init_state(init, tx, plan))
  for step in range(start.step + 1, total + 1):
    state, loss = train_step(state, batch)
    if ckpt.step_done(step, state):  # SIGTERM: saved at the same step everywhere
      break
  ckpt.close(state)

Example:
  >>> import jax.numpy as jnp
  >>> want = leaf_table({"params": {"w": jnp.zeros((4, 2))}})
  >>> want
  {'params/w': ((4, 2), 'float32')}
  >>> first_difference(want, leaf_table({"params": {"w": jnp.zeros((4, 3))}}))
  'params/w has shape (4, 3) float32, this config needs (4, 2) float32'
"""

import dataclasses
import logging as logging_lib
import os
import signal
from collections.abc import Callable
from typing import Any

import jax
import optax
import orbax.checkpoint as ocp
from absl import logging
from jax.experimental import multihost_utils
from orbax.checkpoint import checkpoint_managers as policies
from orbax.checkpoint._src.metadata import array_metadata_store

from bv_sharding import Plan
from trainers import steps
from trainers.errors import ConfigError, OptimizerError
from trainers.optimizers.layout import ParamLayout, reorder, stack_blocks, stack_moves

CHECKPOINTS = "checkpoints"
PARAMS, OPT, META = "params", "opt", "meta"


class CheckpointMismatchError(ConfigError):
  """A checkpoint whose params do not fit this config's model (names, shapes or dtypes)."""


@dataclasses.dataclass(frozen=True)
class Blocking:
  """What a restore needs to move Kron's and Shampoo's block stacks to another mesh.

  ``layout``: this run's :class:`~trainers.optimizers.ParamLayout` (saved in each
  checkpoint's ``meta``); ``optimizer_for(layout)``: this run's optimizer built for a
  layout, so the saving run's blocks are known (:func:`block_moves`).
  """

  layout: ParamLayout
  optimizer_for: Callable[[ParamLayout], optax.GradientTransformation]


@dataclasses.dataclass(frozen=True)
class Start:
  """Where a run starts: ``step`` done so far, ``source`` (a path or "scratch"), ``opt_start``.

  ``opt_start`` is the step the optimizer state was born at (its count is
  ``step - opt_start``), so the logged learning rate is ``lr(step - 1 - opt_start)``.
  """

  step: int
  source: str
  opt_start: int = 0


def leaf_table(tree) -> dict[str, tuple[tuple[int, ...], str]]:
  """``{name: (shape, dtype)}`` for arrays, ``ShapeDtypeStruct``s or orbax metadata.

  Names join the path's keys with "/" (NamedTuple fields and dict keys alike), so
  a tree and the metadata orbax wrote for it have the same table.

  Example: ``leaf_table({"w": jnp.zeros(2)}) == {"w": ((2,), "float32")}``.
  """
  flat, _ = jax.tree_util.tree_flatten_with_path(tree)
  return {"/".join(_key_text(k) for k in path): (tuple(x.shape), str(x.dtype)) for path, x in flat}


def first_difference(want: dict, have: dict) -> str | None:
  """The first leaf (by name) where two ``leaf_table``s differ, described; None if equal.

  Example: ``first_difference({"a": ((2,), "f32")}, {})`` == "'a' is missing ...".
  """
  for name in sorted(want.keys() | have.keys()):
    if name not in have:
      return f"{name} is missing (expected shape {want[name][0]}, {want[name][1]})"
    if name not in want:
      return f"{name} {have[name][0]} {have[name][1]} is not in this config's model"
    if want[name] != have[name]:
      return (
          f"{name} has shape {have[name][0]} {have[name][1]}, this config needs "
          f"{want[name][0]} {want[name][1]}"
      )
  return None


class Checkpoints:
  """The run's orbax ``CheckpointManager``: saves by ``config.ckpt_steps``, at the end, on SIGTERM.

  ``config.ckpt_steps`` (None: only at the end and on preemption) and
  ``config.keep_ckpt_steps`` (checkpoints at multiples of it are never deleted;
  otherwise only the latest is kept) have big_vision's meaning. Saves are async:
  the loop waits for the device-to-host copy and orbax's setup of the write (README:
  cost of a save); orbax writes to a temporary directory and renames it when
  complete, so a cut-off write is never listed.

  Example: ``ckpt = Checkpoints(workdir, config); ckpt.latest_step()``.
  """

  def __init__(self, workdir: str, config, blocking: Blocking | None = None):
    self.directory = os.path.abspath(os.path.join(workdir, CHECKPOINTS))
    self.config, self.blocking = config, blocking
    self.manager = open_manager(
        self.directory,
        ckpt_steps=config.get("ckpt_steps"),
        keep_ckpt_steps=config.get("keep_ckpt_steps"),
        total_steps=config.total_steps,
    )
    self.preemption = Preemption()
    self.opt_start = self.step = 0
    quiet_orbax()

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def restore_or_init(self, plan: Plan, tx: optax.GradientTransformation, fresh) -> tuple:
    """``(state, Start)``: the latest checkpoint, else ``config.model_init``, else ``fresh()``.

    The state lands in ``plan``'s shardings. A checkpoint of another model raises
    ``CheckpointMismatchError`` naming the first differing leaf.
    """
    step = self.latest_step()
    if step is not None:
      state, start = restore(self.manager, step, plan, tx, self.config.optax_name, self.blocking)
    elif self.config.get("model_init"):
      params, source = load_params(self.config.model_init, plan)
      state = {"params": params, "opt": steps.init_opt(tx, plan, params)}
      start = Start(0, source)
      logging.info(
          "params from config.model_init=%s: %s; optimizer state and step start fresh",
          self.config.model_init,
          source,
      )
    else:
      state, start = fresh(), Start(0, "scratch")
    self.opt_start, self.step = start.opt_start, start.step
    return state, start

  def step_done(self, step: int, state) -> bool:
    """Saves if ``step`` is due or preemption was signalled; True when the run must stop now."""
    self.step = step
    preempted = self.preemption.reached(step)
    if preempted or self.manager.should_save(step):
      save(self.manager, step, state, self._meta(step), force=preempted)
    if preempted:
      self.manager.close()  # Waits for the write.
      logging.info("preempted: saved step %d to %s; exiting", step, self.directory)
    return preempted

  def close(self, state) -> None:
    """Saves ``state`` at the last step done (unless saved already); waits for every write."""
    if self.manager.latest_step() != self.step:
      save(self.manager, self.step, state, self._meta(self.step), force=True)
    self.manager.close()

  def _meta(self, step: int) -> dict:
    meta = {"step": step, "optax_name": self.config.optax_name, "opt_start": self.opt_start}
    if self.blocking:
      meta["layout"] = self.blocking.layout.record()
    return meta


def open_manager(
    directory: str,
    *,
    ckpt_steps: int | None = None,
    keep_ckpt_steps: int | None = None,
    total_steps: int | None = None,
    read_only: bool = False,
    use_async: bool = True,
) -> ocp.CheckpointManager:
  """An async ``CheckpointManager`` over ``directory``: the three items, big_vision's policies.

  Example: ``open_manager("/tmp/run/checkpoints", ckpt_steps=100, keep_ckpt_steps=1000)``.
  """
  save_at = [policies.SpecificStepsPolicy(steps=[total_steps] if total_steps else [])]
  if ckpt_steps:
    save_at.append(policies.FixedIntervalPolicy(ckpt_steps))
  keep = [policies.LatestN(n=1)]
  if keep_ckpt_steps:
    keep.append(policies.EveryNSteps(keep_ckpt_steps))
  options = ocp.CheckpointManagerOptions(
      save_decision_policy=policies.AnySavePolicy(save_at),
      preservation_policy=policies.AnyPreservationPolicy(keep),
      enable_async_checkpointing=use_async,
      cleanup_tmp_directories=not read_only,
      read_only=read_only,
      create=not read_only,
  )
  handlers = {PARAMS: tree_handler(), OPT: tree_handler(), META: ocp.JsonCheckpointHandler()}
  return ocp.CheckpointManager(directory, options=options, item_handlers=handlers)


def tree_handler() -> ocp.PyTreeCheckpointHandler:
  """orbax's pytree handler, its ``jax.Array``s written without replica-parallel slicing.

  orbax's default splits every replicated shard into one slice per replica, each a
  jax dispatch in the caller's thread (most of the time a save blocked the loop); here
  replica 0 of each shard writes it whole, by the process that holds it.
  """
  arrays = ocp.type_handlers.ArrayHandler(
      use_replica_parallel=False, array_metadata_store=array_metadata_store.Store()
  )
  others = [
      (t, ocp.type_handlers.get_type_handler(t))
      for t in ocp.type_handlers.supported_types()
      if t is not jax.Array
  ]
  registry = ocp.type_handlers.create_type_handler_registry(*others, (jax.Array, arrays))
  return ocp.PyTreeCheckpointHandler(type_handler_registry=registry)


def tree_restore(target) -> ocp.args.PyTreeRestore:
  """Restore args for one item onto ``target`` (``ShapeDtypeStruct``s carrying shardings)."""
  restore_args = ocp.checkpoint_utils.construct_restore_args(target)
  return ocp.args.PyTreeRestore(item=target, restore_args=restore_args)


def save(manager: ocp.CheckpointManager, step: int, state, meta: dict, force: bool) -> None:
  """Starts an async save of ``state`` (``{"params", "opt"}``) and ``meta`` at ``step``."""
  args = ocp.args.Composite(
      **{
          PARAMS: ocp.args.PyTreeSave(state["params"]),
          OPT: ocp.args.PyTreeSave(state["opt"]),
          META: ocp.args.JsonSave(meta),
      }
  )
  manager.save(step, args=args, force=force)


def check_params(manager: ocp.CheckpointManager, step: int, plan: Plan) -> None:
  """Raises ``CheckpointMismatchError`` unless the saved params fit ``plan``'s params."""
  saved = manager.item_metadata(step)[PARAMS]
  difference = first_difference(leaf_table(plan.abstract()[PARAMS]), leaf_table(saved.tree))
  if difference:
    raise CheckpointMismatchError(
        f"checkpoint {manager.directory / str(step)} is of another model: params/{difference}. "
        "Point --workdir (or config.model_init) at a checkpoint of this config.model, "
        "or use a new workdir"
    )


def restore(
    manager: ocp.CheckpointManager,
    step: int,
    plan: Plan,
    tx,
    optax_name: str,
    blocking: Blocking | None = None,
) -> tuple:
  """``(state, Start)`` from ``step`` in ``plan``'s shardings; new optimizer state if it changed.

  With ``blocking``, block stacks saved on another layout are reordered to this one's
  (same tiles) or the optimizer state is re-initialised (other tiles); see
  :func:`block_moves`.
  """
  check_params(manager, step, plan)
  target = plan.abstract()
  meta = manager.restore(step, args=ocp.args.Composite(**{META: ocp.args.JsonRestore()}))[META]
  saved_opt = leaf_table(manager.item_metadata(step)[OPT].tree)
  why, moves = opt_decision(meta, optax_name, blocking, target, saved_opt)
  items = {PARAMS: tree_restore(target[PARAMS])}
  if not why:
    items[OPT] = tree_restore(target[OPT])
  restored = manager.restore(step, args=ocp.args.Composite(**items))
  source = str(manager.directory / str(step))
  logging.info("resumed at step %d from %s (written by %s)", step, source, meta["optax_name"])
  if not why:
    opt = restored[OPT] if moves is None else reorder_stacks(restored[OPT], moves, target[OPT])
    return {"params": restored[PARAMS], "opt": opt}, Start(step, source, meta["opt_start"])
  logging.info(
      "optimizer state re-initialised (%s): params and step %d restored, new %s state born sharded "
      "from the plan (its count and schedule start at 0)",
      why,
      step,
      optax_name,
  )
  params = restored[PARAMS]
  return {"params": params, "opt": steps.init_opt(tx, plan, params)}, Start(step, source, step)


def opt_decision(meta: dict, optax_name: str, blocking, target, saved_opt: dict) -> tuple:
  """``(why, moves)``: why the saved optimizer state cannot be used (None: it can), and
  :func:`block_moves` to apply to it.

  ``meta``: the checkpoint's; ``target``: the plan's abstract state; ``saved_opt``: the
  ``leaf_table`` of the saved optimizer state.
  """
  if meta["optax_name"] != optax_name:
    return f"config.optax_name changed from {meta['optax_name']!r} to {optax_name!r}", None
  moves = None
  if blocking and "layout" in meta:
    try:
      moves = block_moves(meta["layout"], blocking, target[PARAMS])
    except OptimizerError as e:
      return f"its blocks differ on this mesh: {e}", None
  difference = first_difference(leaf_table(target[OPT]), saved_opt)
  return (difference and f"its state differs: opt/{difference}"), moves


def block_moves(saved: dict, blocking: Blocking, params) -> list | None:
  """How each optimizer state leaf moves from the saving run's layout to ``blocking.layout``.

  ``saved``: the ``ParamLayout.record()`` in the checkpoint's meta. None when the
  layouts are equal; else :func:`~trainers.optimizers.layout.stack_moves` of the
  optimizer built for each, logged in one line. Raises ``OptimizerError`` when a
  stack's blocks differ (the caller re-initialises the state).
  """
  now = blocking.layout.record()
  if saved == now:
    return None
  before, after = (ParamLayout.from_record(r, params) for r in (saved, now))
  stacks = []
  for layout in (before, after):
    tx = blocking.optimizer_for(layout)
    state = jax.eval_shape(tx.init, params)
    stacks.append(stack_blocks(tx, params, state))
  moves = stack_moves(*stacks, [f"opt/{name}" for name in leaf_table(state)])
  logging.info(
      "optimizer state saved on mesh %s, restored on mesh %s: %d of %d block stacks "
      "reordered (same tiles, so each factor still preconditions its own block)",
      dict(saved["mesh"]),
      dict(now["mesh"]),
      sum(m is not None for m in moves),
      sum(b is not None for b in stacks[1]),
  )
  return moves


def reorder_stacks(opt, moves: list, target):
  """``opt`` with each moved stack in its new order, in ``target``'s shardings."""
  leaves, treedef = jax.tree.flatten(opt)
  shardings = [t.sharding for t in jax.tree.leaves(target)]
  moved = [
      x
      if move is None
      else jax.jit(lambda x, move=move: reorder(x, *move), out_shardings=sharding)(x)
      for x, move, sharding in zip(leaves, moves, shardings, strict=True)
  ]
  return treedef.unflatten(moved)


def load_params(path: str, plan: Plan) -> tuple[Any, str]:
  """Params of the checkpoint at ``path`` in ``plan``'s param shardings, and the step directory.

  ``path`` is a workdir, its ``checkpoints`` directory (latest step) or one step's directory.

  Example: ``params, source = load_params("runs/lm", plan)``.
  """
  directory, step = _locate(os.path.abspath(path))
  manager = open_manager(directory, read_only=True) if os.path.isdir(directory) else None
  complete = manager.all_steps() if manager else []
  step = max(complete, default=None) if step is None else step
  if step not in complete:
    raise ConfigError(
        f"config.model_init={path}: no complete checkpoint at {directory}; name a workdir, "
        f"its {CHECKPOINTS}/ directory or one of its step directories"
    )
  check_params(manager, step, plan)
  args = ocp.args.Composite(**{PARAMS: tree_restore(plan.abstract()[PARAMS])})
  params = manager.restore(step, args=args)[PARAMS]
  manager.close()
  return params, os.path.join(directory, str(step))


def _locate(path: str) -> tuple[str, int | None]:
  """(checkpoint directory, step or None: the latest) a workdir, checkpoints/ or step dir names."""
  if os.path.isdir(os.path.join(path, CHECKPOINTS)):
    return os.path.join(path, CHECKPOINTS), None
  if os.path.basename(path).isdigit():
    return os.path.dirname(path), int(os.path.basename(path))
  return path, None


class Preemption:
  """SIGTERM at a step boundary that every process agrees on.

  Several processes: jax's preemption sync point (the coordination service
  catches SIGTERM on any process and picks the same step for all). One process:
  a SIGTERM handler sets a flag read at the next step.

  Example: ``if Preemption().reached(step): save_and_exit()``.
  """

  def __init__(self):
    self.signalled = False
    self.multi = jax.process_count() > 1
    if not self.multi:
      signal.signal(signal.SIGTERM, self._on_sigterm)

  def _on_sigterm(self, signum, frame):
    del signum, frame
    logging.info("SIGTERM: saving at the end of this step")
    self.signalled = True

  def reached(self, step: int) -> bool:
    if self.multi:
      return multihost_utils.reached_preemption_sync_point(step)
    return self.signalled


class _NoOrbaxInfo(logging_lib.Filter):

  def filter(self, record):
    return record.levelno >= logging_lib.WARNING or f"{os.sep}orbax{os.sep}" not in record.pathname


def quiet_orbax() -> None:
  """Drops orbax's INFO lines (dozens per save) from the log; its warnings and errors stay."""
  logger = logging_lib.getLogger("absl")
  if not any(isinstance(f, _NoOrbaxInfo) for f in logger.filters):
    logger.addFilter(_NoOrbaxInfo())


def _key_text(key) -> str:
  for attr in ("key", "name", "idx"):
    if hasattr(key, attr):
      return str(getattr(key, attr))
  return str(key)
