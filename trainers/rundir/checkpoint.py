"""Durable runs: orbax checkpoints of the train state, saved and read back onto the current plan.

A checkpoint (``workdir/checkpoints/<step>/``) holds three orbax items: ``params``,
``opt`` (the optimizer state) and ``meta`` (step, the step the optimizer state was
born at, the optimizer's record: what the run's optimizer's ``record()`` wrote, and every
array's checksum: :mod:`~trainers.rundir.checksums`). Data and RNG are pure functions of
(seed, step), so the step is all the rest of the run needs to continue exactly.

A step that does not check out is never loaded: unreadable files (a truncated or missing
one, an empty stray folder), an array whose checksum is not the one saved with it (bytes
changed on disk) or that has none though the meta records the checksums' format (every save
writes it: sums removed from the meta), or a folder named after another step than its meta
records. A checkpoint whose meta has neither sums nor their format was saved before them: it
is read as it is, with one warning line (:func:`check_sums`). The run says
which step and what failed, moves the step into ``damaged-<step>/`` (nothing is deleted) and
resumes from the newest step that checks out (:meth:`Checkpoints.newest_good`); with none
left it stops in one line. ``load_params`` (``config.model_init``, ``trainers.sample``) falls
back the same way.

Reading never uses the saved shardings: the target is ``plan.abstract()``, the current
config's plan, so a checkpoint moves between meshes and process counts. A floating-point
array saved in another dtype (another ``config.param_dtype`` or ``config.state_dtype``) is
cast to the plan's as orbax reads its shards (:func:`casts`, :func:`cast_note`: "restored
params cast float32 -> bfloat16 (12 leaves)"); a leaf of another name or shape is a
difference (:func:`first_difference`). What a resume makes of what it reads (the optimizer
state kept, moved or born afresh; ``config.model_init``; a fresh init) is the run's:
``trainers/start.py``; saving on SIGTERM is the preemption hook's
(``trainers/hooks/preemption.py``), which calls :meth:`Checkpoints.preempted`.

The training loop's use (it needs a workdir, so it is shown, not run here)::

  ckpt = Checkpoints(workdir, config, migration, plan)
  state, begun = ckpt.newest_good(read) or fresh()  # read(manager, step): start.restore
  ckpt.begin(begun.step, begun.opt_start)  # What the next checkpoints' meta records.
  for step in range(begun.step + 1, total + 1):
    state, loss = train_step(state, batch)
    ckpt.step_done(step, state)  # Saves every config.ckpt_steps.
  ckpt.close(state)

Example:
  >>> import jax.numpy as jnp
  >>> want = leaf_table({"params": {"w": jnp.zeros((4, 2))}})
  >>> want
  {'params/w': ((4, 2), 'float32')}
  >>> first_difference(want, leaf_table({"params": {"w": jnp.zeros((4, 3))}}))
  'params/w has shape (4, 3) float32, this config needs (4, 2) float32'
"""

import collections
import contextlib
import functools
import logging as logging_lib
import os
import re
import resource
import shutil
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from absl import logging
from etils import epath
from jax.experimental import multihost_utils
from orbax.checkpoint import checkpoint_managers as policies
from orbax.checkpoint._src.handlers import pytree_checkpoint_handler
from orbax.checkpoint._src.metadata import array_metadata_store

from bv_sharding import Error, Plan
from trainers.errors import ConfigError
from trainers.rundir import checksums, paths, saver

CHECKPOINTS = "checkpoints"
PARAMS, OPT, META = "params", "opt", "meta"
DAMAGED = "damaged-{}"  # Where a step that does not check out is moved (never deleted).


class DamagedCheckpointError(ConfigError):
  """A checkpoint step that does not check out: unreadable, an array whose checksum is not the
  one saved with it, or a folder not named after the step it holds."""


class CheckpointWriteError(ConfigError):
  """A save that could not write its files: a full disk, a quota, a file size limit.

  orbax's writer threads are still failing when it is raised, so the command exits at once
  after its one line (``cli.fail``), without the interpreter's shutdown reporting on them.
  """

  exit_at_once = True


# The errno codes of a write that found no room, as TensorStore and the OS report them.
NO_ROOM = {28: "no space left on device", 27: "file too large", 122: "disk quota exceeded"}
_OS_ERROR = re.compile(r"os_error_code='(\d+)'|\[Errno (\d+)\]")


def no_room(error: BaseException) -> int | None:
  """The errno of ``error`` when it is a write that found no room (:data:`NO_ROOM`), else None.

  Example:
    >>> no_room(ValueError("Failed to write 5 bytes: File too large [os_error_code='27']"))
    27
    >>> no_room(OSError(28, "No space left on device")), no_room(ValueError("other"))
    (28, None)
  """
  code = getattr(error, "errno", None)
  if code is None:
    found = _OS_ERROR.search(str(error))
    code = found and int(found.group(1) or found.group(2))
  return code if code in NO_ROOM else None


class CheckpointMismatchError(ConfigError):
  """A checkpoint whose params do not fit this config's model (names, shapes, non-float dtypes)."""


def leaf_table(tree) -> dict[str, tuple[tuple[int, ...], str]]:
  """``{name: (shape, dtype)}`` for arrays, ``ShapeDtypeStruct``s or orbax metadata.

  Names join the path's keys with "/" (NamedTuple fields and dict keys alike), so
  a tree and the metadata orbax wrote for it have the same table.

  Example: ``leaf_table({"w": jnp.zeros(2)}) == {"w": ((2,), "float32")}``.
  """
  flat, _ = jax.tree_util.tree_flatten_with_path(tree)
  return {checksums.name(path): (tuple(x.shape), str(x.dtype)) for path, x in flat}


def first_difference(want: dict, have: dict) -> str | None:
  """The first leaf (by name) where two ``leaf_table``s differ, described; None if equal.

  A floating-point leaf of the same shape in another floating-point dtype is no
  difference: restoring casts it (:func:`casts`), so a checkpoint moves between
  ``config.param_dtype``s and ``config.state_dtype``s.

  Example: ``first_difference({"a": ((2,), "f32")}, {})`` == "'a' is missing ...".
  """
  for name in sorted(want.keys() | have.keys()):
    if name not in have:
      return f"{name} is missing (expected shape {want[name][0]}, {want[name][1]})"
    if name not in want:
      return f"{name} {have[name][0]} {have[name][1]} is not in this config's model"
    if want[name] != have[name] and not _castable(want[name], have[name]):
      return (
          f"{name} has shape {have[name][0]} {have[name][1]}, this config needs "
          f"{want[name][0]} {want[name][1]}"
      )
  return None


def casts(want: dict, have: dict) -> dict[str, int]:
  """``{"<saved dtype> -> <dtype>": leaves}``: the casts restoring ``have`` onto ``want`` makes.

  Two ``leaf_table``s; orbax casts each such leaf as it reads its shards into the target's
  shardings, so nothing is gathered whole on one device.

  Example:
    >>> f32, bf16 = ((4, 2), "float32"), ((4, 2), "bfloat16")
    >>> casts({"w": bf16, "b": bf16, "n": ((), "int32")}, {"w": f32, "b": f32, "n": ((), "int32")})
    {'float32 -> bfloat16': 2}
  """
  found = [
      f"{have[n][1]} -> {want[n][1]}"
      for n in sorted(want.keys() & have.keys())
      if want[n] != have[n] and _castable(want[n], have[n])
  ]
  return dict(collections.Counter(found))


def cast_note(casts_by_tree: dict[str, dict[str, int]]) -> str | None:
  """One log line naming each tree's :func:`casts`; None when nothing is cast.

  Example:
    >>> cast_note({"params": {"float32 -> bfloat16": 12}, "opt state": {}})
    'restored params cast float32 -> bfloat16 (12 leaves)'
  """
  parts = [
      f"{tree} cast {how} ({n} leaves)"
      for tree, found in casts_by_tree.items()
      for how, n in found.items()
  ]
  return "restored " + "; ".join(parts) if parts else None


def _castable(want: tuple, have: tuple) -> bool:
  """Whether two ``(shape, dtype)`` rows are one floating-point array in two dtypes."""
  floating = lambda name: jnp.issubdtype(jnp.dtype(name), jnp.floating)
  return want[0] == have[0] and floating(want[1]) and floating(have[1])


class Checkpoints:
  """The run's orbax ``CheckpointManager``: saves by ``config.ckpt_steps``, at the end, on SIGTERM.

  ``config.ckpt_steps`` (None: only at the end and on preemption) and
  ``config.keep_ckpt_steps`` (checkpoints at multiples of it are never deleted;
  otherwise only the latest is kept) have big_vision's meaning. Saves do not stall the loop:
  it waits only for the device-to-host copy of the state (trainers/rundir/saver.py); orbax's
  setup runs on a background thread and its write on orbax's own (docs/benchmarks.md: cost of
  a save). orbax writes to a temporary directory and renames it when complete (in a bucket: a
  commit file), so a cut-off write is never listed.

  ``migration``: the run's optimizer; its ``record()`` goes into each checkpoint's meta
  (``trainers.start.Migration``).
  ``plan``: the state's plan, which sizes each item's write budget (:func:`saver.write_budget`:
  at most a quarter of the state being written at once); None: orbax's default. ``form``:
  the form the state is saved in (:class:`trainers.stored.StoredForm`; its plan then sizes
  the budget), None: as the run holds it.

  Example: ``ckpt = Checkpoints(workdir, config, migration, plan); ckpt.latest_step()``.
  """

  def __init__(self, workdir: str, config, migration, plan: Plan | None = None, form=None):
    quiet_orbax()  # Before the manager is made: its creation logs a dozen INFO lines.
    self.directory = os.fspath(_absolute(workdir) / CHECKPOINTS)
    self.config, self.migration = config, migration
    self.stored = (lambda state: state) if form is None else form.to_stored
    plan = plan if form is None else form.plan
    abstract = plan.abstract() if plan else {}
    self.state_bytes = plan.total_bytes if plan else 0
    self.manager = open_manager(
        self.directory,
        ckpt_steps=config.ckpt_steps,
        keep_ckpt_steps=config.keep_ckpt_steps,
        total_steps=config.total_steps,
        write_bytes={item: saver.write_budget(tree) for item, tree in abstract.items()},
    )
    self.opt_start = self.step = 0
    self.saved: int | None = None  # The step of the last save started.
    self.saver = saver.BackgroundSaver()

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def newest_named_step(self) -> int | None:
    """The newest step whose meta item reads and records the step its folder is named after
    (:func:`read_meta`), None without one: the newest a resume can start from (a renamed or
    empty stray step folder is not; its data is checked when it is restored)."""
    for step in sorted(self.manager.all_steps(), reverse=True):
      with contextlib.suppress(DamagedCheckpointError):
        read_meta(self.manager, step)
        return step
    return None

  def newest_good(self, read: Callable[[ocp.CheckpointManager, int], Any]) -> Any | None:
    """``read(manager, step)`` of the newest step that checks out, None without one; each step
    that does not (``read`` raised ``DamagedCheckpointError``) is logged and moved aside into
    ``damaged-<step>`` (``DamagedCheckpointError`` when none is left). The run's ``read`` is
    ``trainers.start.restore``."""
    damaged = []
    for step in sorted(self.manager.all_steps(), reverse=True):
      try:
        return read(self.manager, step)
      except DamagedCheckpointError as e:
        logging.warning("%s; trying the previous checkpoint", e)
        damaged.append(str(e))
        self._move_aside(step)
    if damaged:
      raise DamagedCheckpointError(
          f"no checkpoint in {self.directory} checks out ({'; '.join(damaged)}); they were moved "
          f"into {DAMAGED.format('<step>')}: run again to start fresh"
      )
    return None

  def begin(self, step: int, opt_start: int = 0) -> None:
    """The run goes on from ``step``, its optimizer state born at ``opt_start``: what the next
    checkpoints' meta records (and the step a save at the end falls back to)."""
    self.step, self.opt_start = step, opt_start

  def _move_aside(self, step: int) -> None:
    """Process 0 moves damaged step ``step`` into ``damaged-<step>``; every process waits."""
    if jax.process_index() == 0:
      directory = paths.path(self.directory)
      aside = directory / DAMAGED.format(step)
      n = 1
      while aside.exists():  # An earlier run's step of this number was damaged too.
        aside, n = directory / f"{DAMAGED.format(step)}.{n}", n + 1
      paths.move(directory / str(step), aside)
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices(f"moved aside {step}")
    self.manager.reload()

  def step_done(self, step: int, state, before_save: Callable = lambda: None) -> bool:
    """Saves if ``step`` is due (``config.ckpt_steps``); False: the run goes on.

    ``before_save()`` runs first, in the loop (it reads the pending losses: a non-finite one
    raises), and returns what the checkpoint must follow: a wait (or None) that the save
    calls on its own thread before it saves, so the checkpoint is committed after it (the
    records up to ``step`` in a bucket: the loop's ``Pending``) while the loop goes on.
    """
    self.step = step
    if self.manager.should_save(step):
      self._save(step, state, before_save, force=False)
    return False

  def preempted(self, step: int, state, before_save: Callable = lambda: None) -> bool:
    """Saves ``step`` (unless saved already) and waits for the write: the run was preempted
    (``trainers/hooks/preemption.py``) and stops now, so True. ``before_save``: as for
    :meth:`step_done`."""
    self.step = step
    if self.saved != step:
      self._save(step, state, before_save, force=True)
    with self.writing():
      self.saver.wait()
      self.manager.close()  # Waits for the write.
    logging.info("preempted: saved step %d to %s; exiting", step, self.directory)
    return True

  def _save(self, step: int, state, before_save: Callable, force: bool) -> None:
    """Starts a save of ``state`` at ``step``, the loop waiting only for its host copy."""
    self.check_room()
    follows = before_save()
    with self.writing():
      self.saver.wait()  # The previous save's setup (raises its error); its write goes on.
    state = self.stored(state)
    meta = self._meta(step, state)
    state = saver.host_copy(state)  # All the loop waits for: the state is donated next.
    self.saver.submit(save_after, follows, self.manager, step, state, meta, force)
    self.saved = step

  def close(self, state, before_save: Callable = lambda: None) -> None:
    """Saves ``state`` at the last step done (unless saved already; after ``before_save()``
    and the wait it returns, as for :meth:`step_done`); waits for every write."""
    follows = before_save()
    with self.writing():
      self.saver.wait()
      if self.manager.latest_step() != self.step:
        self.check_room()
        state = self.stored(state)
        meta = self._meta(self.step, state)
        save_after(follows, self.manager, self.step, state, meta, force=True)
      self.manager.close()

  @contextlib.contextmanager
  def released_on_error(self):
    """Closes the manager and the save thread, without saving, if the block raises: a run
    that stops before training leaves no thread to meet the interpreter's shutdown."""
    try:
      yield
    except BaseException:
      self.saver.shutdown()
      self.manager.close()
      raise

  @contextlib.contextmanager
  def writing(self):
    """Turns a save's write that found no room (:func:`no_room`) into ``CheckpointWriteError``:
    the directory, why, the bytes a checkpoint needs and the last complete one."""
    try:
      yield
    except Error:
      raise
    except Exception as e:
      code = no_room(e)
      if code is None:
        raise
      raise self._no_room(code, "failed") from None

  def check_room(self) -> None:
    """Raises ``CheckpointWriteError`` before a save that cannot fit in a local directory: less
    free space than the state's bytes (ENOSPC), or a file size limit (``ulimit -f``) below them
    (EFBIG), so orbax never starts a write that would fail on its threads."""
    if paths.is_url(self.directory) or not self.state_bytes:
      return
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    existing = next(
        p
        for p in (self.directory, *map(str, epath.Path(self.directory).parents))
        if os.path.exists(p)
    )
    if shutil.disk_usage(existing).free < self.state_bytes:
      raise self._no_room(28, "would fail")
    if limit != resource.RLIM_INFINITY and limit < self.state_bytes:
      raise self._no_room(27, f"would fail (this process's file size limit: {limit} bytes)")

  def _no_room(self, code: int, outcome: str) -> CheckpointWriteError:
    """The one line of a save that found (or would find) no room: the directory, why, the
    bytes a checkpoint needs and the last complete one."""
    need = f"about {self.state_bytes / 2**20:.1f} MiB" if self.state_bytes else "room"
    done = _complete_steps(self.directory)
    last = f"step {max(done)} is intact" if done else "no checkpoint was completed yet"
    return CheckpointWriteError(
        f"saving a checkpoint into {self.directory} {outcome}: {NO_ROOM[code]} (errno {code}). "
        f"A checkpoint of this state needs {need} there: free it, or give another --workdir "
        f"(the last checkpoint, {last})"
    )

  def _meta(self, step: int, state) -> Callable[[], dict]:
    """The meta item of ``state``'s checkpoint at ``step``, with each array's checksum: the
    checksums' program dispatched now (before ``state`` is donated), the item made when the
    returned function is called (on the save's thread, which waits for the sums)."""
    sums = checksums.start(state)
    record = {**self.migration.record(), "step": step, "opt_start": self.opt_start}
    return lambda: {**record, checksums.SUMS: sums(), checksums.SUMS_FORMAT: checksums.FORMAT}


def open_manager(
    directory: str,
    *,
    ckpt_steps: int | None = None,
    keep_ckpt_steps: int | None = None,
    total_steps: int | None = None,
    read_only: bool = False,
    use_async: bool = True,
    write_bytes: dict[str, int] | None = None,
) -> ocp.CheckpointManager:
  """An async ``CheckpointManager`` over ``directory``: the three items, big_vision's policies.

  ``write_bytes``: ``{item: bytes}``, the bytes a save of ``PARAMS`` / ``OPT`` may have in
  flight (:func:`tree_handler`); an item not named keeps orbax's default.

  Example: ``open_manager("/tmp/run/checkpoints", ckpt_steps=100, keep_ckpt_steps=1000)``.
  """
  save_at = [policies.SpecificStepsPolicy(steps=[total_steps] if total_steps else [])]
  if ckpt_steps:
    save_at.append(policies.FixedIntervalPolicy(ckpt_steps))
  keep = [policies.LatestN(n=1)]
  if keep_ckpt_steps:
    keep.append(policies.EveryNSteps(keep_ckpt_steps))
  # Naming every process makes orbax's barriers the coordination service's, never device
  # collectives, so a save may run beside the train steps in another thread (orbax then
  # leaves creating the directory to its caller).
  processes = set(range(jax.process_count()))
  if not read_only:
    paths.path(directory).mkdir(parents=True, exist_ok=True)
  options = ocp.CheckpointManagerOptions(
      save_decision_policy=policies.AnySavePolicy(save_at),
      preservation_policy=policies.AnyPreservationPolicy(keep),
      enable_async_checkpointing=use_async,
      cleanup_tmp_directories=not read_only,
      read_only=read_only,
      create=False,
      multiprocessing_options=ocp.options.MultiprocessingOptions(active_processes=processes),
  )
  budget = write_bytes or {}
  handlers = {item: tree_handler(budget.get(item)) for item in (PARAMS, OPT)}
  handlers[META] = ocp.JsonCheckpointHandler()
  return _Manager(directory, options=options, item_handlers=handlers)


class _Manager(ocp.CheckpointManager):
  """orbax's manager, leaving jax's preemption sync point to the loop
  (``trainers/hooks/preemption.py``).

  jax's sync point must be asked once per step, in step order: it reports the last step it
  was asked about when a SIGTERM arrives, and the processes stop one step after the highest.
  orbax asks it too, from the threads that save and finalize, about the step they save,
  which set that count back while the loop has moved on (two processes then agreed on a step
  their loops had passed and never stopped). The preemption hook saves itself
  (:meth:`Checkpoints.preempted`).
  """

  def reached_preemption(self, step: int) -> bool:
    del step
    return False


def tree_handler(write_bytes: int | None = None) -> ocp.PyTreeCheckpointHandler:
  """orbax's pytree handler, its ``jax.Array``s written uncompressed, without replica-parallel
  slicing.

  orbax's default splits every replicated shard into one slice per replica, each a
  jax dispatch in the caller's thread (most of the time a save held up the loop); here
  replica 0 of each shard writes it whole, by the process that holds it. Uncompressed,
  TensorStore writes each shard from the save's host copy by reference, where zstd would
  encode it into a buffer of its own first: up to ``write_bytes`` more host memory a save,
  for checkpoints about 9% smaller (docs/benchmarks.md, cost of a save). Checkpoints
  written compressed read as they are.
  ``write_bytes``: orbax's in-flight limit of a save (``save_concurrent_bytes``: shards
  being written at once; it must exceed the largest shard), None: orbax's default (96 GB,
  i.e. every shard at once). The layout is orbax's (OCDBT, zarr).
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
  impl = None
  if write_bytes is not None:
    impl = ocp.BasePyTreeCheckpointHandler(
        save_concurrent_bytes=write_bytes,
        restore_concurrent_bytes=pytree_checkpoint_handler.DEFAULT_CONCURRENT_GB * 10**9,
        type_handler_registry=registry,
        use_compression=False,
    )
  return ocp.PyTreeCheckpointHandler(
      type_handler_registry=registry, handler_impl=impl, use_compression=False
  )


def tree_restore(target) -> ocp.args.PyTreeRestore:
  """Restore args for one item onto ``target`` (``ShapeDtypeStruct``s carrying shardings)."""
  restore_args = ocp.checkpoint_utils.construct_restore_args(target)
  return ocp.args.PyTreeRestore(item=target, restore_args=restore_args)


def restore_item(
    manager: ocp.CheckpointManager,
    step: int,
    item: str,
    target,
    meta=None,
    saved: dict | None = None,
    verify: bool = True,
):
  """One item (``PARAMS`` or ``OPT``) of the checkpoint at ``step``, onto ``target``.

  Its arrays are read in the dtypes they were saved in, checked against the checksums saved
  with them (:func:`check_sums`: a resume, ``config.model_init`` and ``trainers.sample`` alike),
  then cast to ``target``'s. Raises ``DamagedCheckpointError`` naming the step and the leaf.
  ``meta``: the step's meta item, ``saved``: the item's :func:`leaf_table` as saved, where the
  caller has read them already. ``verify=False``: the same read, nothing checked (what the
  checks cost is measured against it: ``benchmarks.checkpoint``).
  """
  with reading(manager, step):
    if saved is None:
      saved = leaf_table(manager.item_metadata(step)[item].tree)
    raw = jax.tree_util.tree_map_with_path(
        lambda path, t: _in_saved_dtype(t, saved.get(checksums.name(path))),
        target,
        is_leaf=lambda x: x is ocp.PLACEHOLDER,
    )
    tree = manager.restore(step, args=ocp.args.Composite(**{item: tree_restore(raw)}))[item]
    if verify and meta is None:
      meta = read_meta(manager, step)
  if verify:
    check_sums(manager.directory / str(step), item, tree, meta)
  return jax.tree.map(_cast, tree, target, is_leaf=lambda x: x is ocp.PLACEHOLDER)


def check_sums(path: epath.Path, item: str, tree, meta: dict) -> None:
  """Checks the arrays ``tree`` of ``item``, read from the checkpoint at ``path``, against the
  sums its ``meta`` saved (:func:`checksums.damage`): ``DamagedCheckpointError`` naming the step
  and the leaf. A meta with neither sums nor their format (saved before them) is read as it is,
  said in one warning line (with the params, which every read of a checkpoint reads once).

  Example: ``check_sums(manager.directory / "8", PARAMS, params, read_meta(manager, 8))``.
  """
  format = checksums.recorded(meta)
  if format is None:
    if item == PARAMS:
      logging.warning(
          "checkpoint %s records no checksums (saved before they were written): its arrays "
          "cannot be verified; it is read as it is",
          path,
      )
    return
  read = {f"{item}/{leaf}": s for leaf, s in checksums.of(tree, format).items()}
  if found := checksums.damage(meta, read):
    raise DamagedCheckpointError(f"checkpoint {path}: {found}")


def _in_saved_dtype(target, saved: tuple | None):
  """``target`` (a ``ShapeDtypeStruct``) in the dtype of ``saved`` (``leaf_table``'s entry)."""
  if target is ocp.PLACEHOLDER or saved is None:
    return target
  return jax.ShapeDtypeStruct(target.shape, jnp.dtype(saved[1]), sharding=target.sharding)


def _cast(x, target):
  """``x`` in ``target``'s dtype, in its own sharding."""
  if target is ocp.PLACEHOLDER or x.dtype == target.dtype:
    return x
  return _astype(x, jnp.dtype(target.dtype))


@functools.partial(jax.jit, static_argnums=1)
def _astype(x, dtype):
  """``x.astype(dtype)``, one compiled program per shape and dtypes (not one per call)."""
  return x.astype(dtype)


@contextlib.contextmanager
def reading(manager: ocp.CheckpointManager, step: int):
  """Turns an error reading step ``step`` (orbax's, TensorStore's, a file's: anything but the
  project's own) into ``DamagedCheckpointError`` naming the step and what failed."""
  try:
    yield
  except Error:
    raise
  except Exception as e:  # Whatever a damaged file makes the readers raise.
    what = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
    raise DamagedCheckpointError(
        f"checkpoint {manager.directory / str(step)} cannot be read ({type(e).__name__}: {what})"
    ) from None


def read_meta(manager: ocp.CheckpointManager, step: int) -> dict:
  """The meta item of step ``step``; ``DamagedCheckpointError`` if it is unreadable or records
  another step (a renamed folder)."""
  with reading(manager, step):
    meta = manager.restore(step, args=ocp.args.Composite(**{META: ocp.args.JsonRestore()}))[META]
  if meta.get("step", step) != step:
    raise DamagedCheckpointError(
        f"checkpoint {manager.directory / str(step)} holds step {meta['step']}: its folder "
        "was renamed"
    )
  return meta


def save_after(
    follows, manager: ocp.CheckpointManager, step: int, state, meta: Callable[[], dict], force: bool
):
  """:func:`save` of the item ``meta()`` makes, once ``follows()`` returned (None: at once): a
  save's own thread waits for what its checkpoint must not be committed before (the records up
  to ``step``), and for the checksums."""
  if follows is not None:
    follows()
  save(manager, step, state, meta(), force)


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


def saved_tables(manager: ocp.CheckpointManager, step: int) -> tuple[dict, dict]:
  """``(params, opt)``: the :func:`leaf_table` of each item saved at ``step``, from their
  metadata (no array read); ``DamagedCheckpointError`` if it cannot be read."""
  with reading(manager, step):
    metadata = manager.item_metadata(step)
    return tuple(leaf_table(metadata[item].tree) for item in (PARAMS, OPT))


def check_params(
    manager: ocp.CheckpointManager, step: int, plan: Plan, saved: dict | None = None
) -> dict[str, int]:
  """The :func:`casts` restoring the saved params onto ``plan``'s makes (another
  ``config.param_dtype``); raises ``CheckpointMismatchError`` unless they fit otherwise.
  ``saved``: the params' :func:`leaf_table` as saved, where the caller has read it."""
  want = leaf_table(plan.abstract()[PARAMS])
  if saved is None:
    with reading(manager, step):
      saved = leaf_table(manager.item_metadata(step)[PARAMS].tree)
  difference = first_difference(want, saved)
  if difference:
    raise CheckpointMismatchError(
        f"checkpoint {manager.directory / str(step)} is of another model: params/{difference}. "
        "Point --workdir (or config.model_init) at a checkpoint of this config.model, "
        "or use a new workdir"
    )
  return casts(want, saved)


def restore_leaves(
    manager: ocp.CheckpointManager,
    step: int,
    item: str,
    targets: dict,
    meta=None,
    verify: bool = True,
) -> dict:
  """``{name: array}``: the leaves of ``item`` that ``targets`` names (:func:`leaf_table`'s
  names), each read onto its target's shape, dtype and sharding; the rest is not read.
  ``meta``, ``verify``: as for :func:`restore_item`."""
  with reading(manager, step):
    tree = manager.item_metadata(step)[item].tree
  target = jax.tree_util.tree_map_with_path(
      lambda path, _: targets.get(checksums.name(path), ocp.PLACEHOLDER), tree
  )
  read = restore_item(manager, step, item, target, meta, leaf_table(tree), verify)
  flat, _ = jax.tree_util.tree_flatten_with_path(read)
  return {checksums.name(path): x for path, x in flat if checksums.name(path) in targets}


def load_params(path: str, plan: Plan) -> tuple[Any, str]:
  """Params of the checkpoint at ``path`` in ``plan``'s param shardings (and dtypes: a cast is
  logged), and the step directory.

  ``path`` is a workdir, its ``checkpoints`` directory (latest step) or one step's directory.

  Example: ``params, source = load_params("runs/lm", plan)``.
  """
  directory, step = _locate(_absolute(path))
  manager = open_manager(directory, read_only=True) if directory.is_dir() else None
  complete = manager.all_steps() if manager else []
  if step is not None and step not in complete or not complete:
    raise ConfigError(
        f"config.model_init={path}: no complete checkpoint at {directory}; name a workdir, "
        f"its {CHECKPOINTS}/ directory or one of its step directories"
    )
  tried = [step] if step is not None else sorted(complete, reverse=True)
  for i, step in enumerate(tried):
    try:
      meta = read_meta(manager, step)
      with reading(manager, step):
        saved = leaf_table(manager.item_metadata(step)[PARAMS].tree)
      if note := cast_note({"params": check_params(manager, step, plan, saved)}):
        logging.info("%s", note)
      params = restore_item(manager, step, PARAMS, plan.abstract()[PARAMS], meta, saved)
      break
    except DamagedCheckpointError as e:
      if i == len(tried) - 1:
        raise
      logging.warning("%s; trying the previous checkpoint", e)
  manager.close()
  return params, os.fspath(directory / str(step))


def _complete_steps(directory: str) -> list[int]:
  """The steps of ``directory``'s complete checkpoints (folders named by a number)."""
  folder = paths.path(directory)
  return [int(p.name) for p in folder.iterdir() if p.name.isdigit()] if folder.exists() else []


def _absolute(location: str) -> epath.Path:
  """A workdir or checkpoint ``location`` as an absolute ``epath.Path`` (a URL as it is)."""
  return paths.path(location if paths.is_url(location) else os.path.abspath(location))


def _locate(path: epath.Path) -> tuple[epath.Path, int | None]:
  """(checkpoint directory, step or None: the latest) a workdir, checkpoints/ or step dir names."""
  if (path / CHECKPOINTS).is_dir():
    return path / CHECKPOINTS, None
  if path.name.isdigit():
    return path.parent, int(path.name)
  return path, None


# orbax's warnings about a manager opened read-only, which ours are on purpose (restores).
READ_ONLY_NOTES = ("CheckpointManagerOptions.read_only=True", "Given directory is read only")


class _NoOrbaxInfo(logging_lib.Filter):

  def filter(self, record):
    if f"{os.sep}orbax{os.sep}" not in record.pathname:
      return True
    if record.levelno < logging_lib.WARNING or record.getMessage().startswith(READ_ONLY_NOTES):
      return False
    error = record.exc_info[1] if record.exc_info else ValueError(record.getMessage())
    return no_room(error) is None  # Reported in one line as CheckpointWriteError.


def quiet_orbax() -> None:
  """Drops orbax's INFO lines (dozens per save) from the log, its warnings about a manager opened
  read-only (ours are, on purpose), and its errors about a write that found no room (each
  thread's traceback: :meth:`Checkpoints.writing` says it in one line); its other warnings and
  errors stay."""
  logger = logging_lib.getLogger("absl")
  if not any(isinstance(f, _NoOrbaxInfo) for f in logger.filters):
    logger.addFilter(_NoOrbaxInfo())
