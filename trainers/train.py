r"""Trains a model with params and optimizer state sharded by one ``config.sharding_strategy``.

  python -m trainers.train --config configs/lm.py --workdir /tmp/lm
  python -m trainers.train --config configs/lm.py:size=small --workdir /tmp/lm \
      --config.optax_name=kron --config.total_steps=500
  python -m trainers.launch --processes 2 --devices_per_process 4 -- \
      --config configs/lm.py --workdir /tmp/lm2      # 2 jax.distributed processes

Top to bottom: logging -> (jax.distributed) -> mesh -> the run (data, model, optimizer,
one sharding plan for {"params", "opt"}: trainers/build.py) -> born-sharded init -> loop -> eval.
Every config value is checked first (trainers/settings/validation.py), the memory the plan needs
and that of the train step, compiled once from abstract inputs (activations too:
trainers/figures/memory.py; ``config.device_memory_gib`` plans another machine), before init;
a bad one ends the run as one line, ``ConfigError: config.<key>=...``, before
the workdir is touched or anything allocated (``--debug`` for the traceback). Process 0 then
writes ``workdir/config.json`` and ``workdir/metrics.jsonl``; an earlier run's files there are
moved into ``workdir/attempt-N/`` (trainers/rundir/workdir.py). Every process saves orbax
checkpoints (every ``config.ckpt_steps``, at the end, on SIGTERM); a workdir holding one
resumes from it exactly (trainers/rundir/checkpoint.py). A NaN or infinite loss stops the run
(``config.on_nonfinite="stop"``) or skips the update ("skip"; trainers/hooks/divergence.py).

The train step is compiled once, ahead of time, from the plan's abstract state
(``build.compile_step``); its model FLOPs, counted from its traced program (every scanned
layer and microbatch), give TFLOP/s and MFU per device (trainers/figures/utilization.py). The loop
(trainers/loop.py; profile trace, eval, metrics, checkpoints and preemption hung on as hooks
by the command: trainers/hooks/) never waits for the device between log steps: step k+1 is dispatched before anything of step k is read, and
the step metrics (loss, ``l2_grads``, ``l2_params``, ``l2_updates``) are fetched together
at log, eval and checkpoint steps, on SIGTERM and at the end, then checked in step order.
Process 0 also writes them as TensorBoard scalars into ``workdir/tensorboard/``. In a
``gs://`` workdir both go to the bucket from background threads, as new objects, and the loop
waits for them only before a checkpoint save and at the end (trainers/rundir/parts.py);
``config.profile_steps`` traces steps into ``workdir/profile/`` (trainers/rundir/profiling.py).

On CPU every process simulates ``--devices_per_process`` devices (default 8);
``--coordinator_address/--num_processes/--process_id`` (or BV_COORDINATOR,
BV_NUM_PROCESSES, BV_PROCESS_ID) start jax.distributed; without them a job jax
detects (TPU pod, SLURM, ...) starts it from the environment (``--nodistributed_auto``: off).
Before allocating, every process checks that all run the same job (config, data files,
versions: trainers/hosts/same_job.py) and computed the same plan, and
``config.max_unsharded_fraction`` (if set) gates the plan's coverage.
"""

import logging as logging_lib
import os

from trainers import ONE_BLAS_THREAD

os.environ.setdefault(*ONE_BLAS_THREAD)  # Before numpy loads OpenBLAS (trainers/__init__.py).

import flax.linen as nn
import jax
from absl import flags, logging
from jax.experimental import multihost_utils

import bv_sharding as bvs
from trainers import build, fit, loop, start, steps
from trainers.errors import ConfigError
from trainers.figures import memory
from trainers.hooks import divergence, preemption
from trainers.hooks import metrics as metrics_hook
from trainers.hosts import distributed, same_job
from trainers.input import prefetch, records
from trainers.rundir import checkpoint, events, lock, parts, profiling, provenance, workdir
from trainers.settings import cli, held, schema, validation

PLAN_TABLE = "plan.txt"  # The plan's whole table, in each start's folder (workdir/starts/<i>).
_CONFIG = cli.define_config_flag()
flags.adopt_module_key_flags(cli)  # --help lists --config and --debug too.
_WORKDIR = flags.DEFINE_string(
    "workdir", None, "Where config.json and metrics.jsonl go.", required=True
)
_LEASE = flags.DEFINE_float(
    "workdir_lease",
    lock.LEASE_S,
    "Seconds a gs:// workdir's lock lasts unrenewed (the run renews it every quarter of that): "
    "a killed run's lock is taken over this long after its last renewal.",
    lower_bound=1.0,
)
_COORDINATOR = flags.DEFINE_string(
    "coordinator_address",
    os.environ.get("BV_COORDINATOR"),
    "host:port of process 0; starts jax.distributed.",
)
_NUM_PROCESSES = flags.DEFINE_integer(
    "num_processes",
    int(os.environ.get("BV_NUM_PROCESSES", 1)),
    "Number of jax.distributed processes.",
)
_PROCESS_ID = flags.DEFINE_integer(
    "process_id",
    int(os.environ.get("BV_PROCESS_ID", 0)),
    "This process's id in [0, num_processes).",
)
_DISTRIBUTED_TIMEOUT = flags.DEFINE_integer(
    "distributed_timeout",
    300,
    "Seconds jax.distributed waits for every process to connect before the run stops.",
)
_AUTO = flags.DEFINE_bool(
    "distributed_auto",
    True,
    "Without --coordinator_address, start jax.distributed where jax detects a cluster "
    "(TPU pods, SLURM, Open MPI, Kubernetes); --nodistributed_auto for single-host runs.",
)
_PRINT_PLAN = flags.DEFINE_bool(
    "print_plan",
    False,
    "Log the sharding plan's whole table (one row per leaf); without it the run logs the plan's "
    "summary and writes the table to workdir/starts/<i>/plan.txt.",
)
_DEVICES = flags.DEFINE_integer(
    "devices_per_process",
    distributed.simulated_devices(),
    "Simulated devices per process on the CPU backend "
    "(jax_num_cpu_devices); GPU/TPU backends ignore it.",
)


def main(argv):
  del argv
  held.hold()  # Start-up lines print once the checks pass: a mistake is the first line.
  config = schema.of(_CONFIG.value)  # Typed once: trainers/settings/schema.py.
  validation.check_config(
      config,
      devices_per_process=_DEVICES.value,
      num_processes=_NUM_PROCESSES.value,
      process_id=_PROCESS_ID.value,
  )
  workdir.check(_WORKDIR.value)
  lock.check_free(_WORKDIR.value)  # Another run on this workdir stops this one here.
  start_backend()
  same_job.check(config, job_facts())  # Every host runs this job.
  is_main_process = jax.process_index() == 0
  mesh = bvs.make_mesh(config.mesh, dcn_mesh=config.dcn_mesh, axis_types=config.mesh_axis_types)
  log_batch_split(config, mesh)
  # The token files' record, task, model, the config's optimizer for the params' layout and
  # one plan of {"params", "opt"}: trainers/build.py.
  run = build.build(config, mesh)
  config = run.config
  share = multihost_utils.broadcast_one_to_all if jax.process_count() > 1 else None
  scans = records.ScanCache(_WORKDIR.value, is_main_process, share)  # Process 0 scans, once.
  run.task.check(run.model, scans)  # Token ids / labels fit the model, before init.
  plan = check_plan(config, run.plan, is_main_process)
  # Compiled once, from abstract inputs: its memory (activations too) checked before init.
  step = check_compiled(run)
  cost = metrics_hook.step_cost(run, step.batch_sharding)
  eval_batches = build.eval_batches(run)
  evaluate = lambda params: loop.mean_loss(step.eval, params, eval_batches, step.batch_sharding)

  # Every check passed: only now is the workdir touched, by the run that holds it.
  holding = lock.hold(_WORKDIR.value, _LEASE.value) if is_main_process else None
  took_over = holding.took_over() if holding else None  # A dead run's lock: whose, how ended.
  if took_over:
    logging.warning("%s", took_over)
  # The optimizers say what becomes of restored state (Kron's, Shampoo's stacks on another mesh).
  ckpt, metrics = open_workdir(_WORKDIR.value, config, run, is_main_process)
  preempted = preemption.Preemption()  # SIGTERM: a save at the same step on every process.
  scans.save()
  curves = events.EventWriter(_WORKDIR.value)  # Opened by process 0's first record.
  write = metrics_hook.fan_out(metrics, curves) if is_main_process else None

  def written():
    """A wait for the records queued so far (a bucket's writers send them in the background),
    before each save; a run whose workdir lock another run took over stops here."""
    if holding:
      holding.check()
    return parts.each([metrics.until_written(), curves.until_written()])

  watch = divergence.LossWatch(config.on_nonfinite, config.lr, write=write)
  out_of_memory = memory.converted(plan, "the run's restore, train or eval steps")
  with jax.set_mesh(mesh), nn.logical_axis_rules(config.sharding_rules), out_of_memory:
    with ckpt.released_on_error():
      state, begun = start.restore_or_init(ckpt, run)
    if is_main_process:
      note_start(_WORKDIR.value, config, begun, metrics.path, curves, plan)
    local_batches = run.task.batches(
        run.task.train, global_batch=config.batch_size, seed=config.seed, start_step=begun.step
    )
    train_batches = prefetch.to_device(local_batches, step.batch_sharding, run.task.prefetch)
    log = metrics_hook.StepLog(config, run.task, run.learning_rates, begun, evaluate, write, cost)
    todo = range(begun.step + 1, config.total_steps + 1)
    trace = profiling.StepTrace(config.profile_steps, _WORKDIR.value)
    try:
      looped = loop.Loop(step.train, watch, plan, config, written)
      looped.add_hook(trace.after, name="profile", before=trace.before)
      looped.add_hook(looped.pending.evaluate, every=config.eval_every, name="eval")
      looped.add_hook(name="metrics", every=config.log_every, read=log)  # jsonl, TensorBoard.
      looped.add_checkpointer(ckpt)  # Every config.ckpt_steps and at the end.
      save = looped.settled(ckpt.preempted)
      looped.add_hook(preemption.hook(preempted, save), name="preemption")
      looped.run(state, zip(todo, train_batches))
    finally:
      trace.close()
      curves.close()
      metrics.close()
      if holding:
        holding.release()


def start_backend() -> None:
  """Sets the simulated CPU device count and starts jax.distributed (if any).

  Both must happen before anything starts the backend. Logs one line: the platform, the
  process and device counts and how jax.distributed started; then a warning if detecting the
  cluster failed (``cpu: process 0 of 1, 8 devices (8 here); jax.distributed: single process``).
  """
  jax.config.update("jax_num_cpu_devices", _DEVICES.value)
  # jax's INFO line for each backend it could not start ("Unable to initialize backend 'tpu'")
  # would come first on every host without that accelerator; its warnings still show.
  logging_lib.getLogger("jax._src.xla_bridge").setLevel(logging_lib.WARNING)
  how, note = distributed.start(
      _COORDINATOR.value,
      _NUM_PROCESSES.value,
      _PROCESS_ID.value,
      _AUTO.value,
      _DISTRIBUTED_TIMEOUT.value,
  )
  logging.info(
      "%s: process %d of %d, %d devices (%d here); jax.distributed: %s",
      jax.default_backend(),
      jax.process_index(),
      jax.process_count(),
      jax.device_count(),
      jax.local_device_count(),
      how,
  )
  if note:
    logging.warning("%s", note)


def job_facts() -> dict[str, str]:
  """What names this job besides its config: ``--workdir``, package versions, git revision."""
  facts = {f"version {name}": version for name, version in provenance.versions().items()}
  return {"--workdir": _WORKDIR.value, "git revision": provenance.git_revision(), **facts}


def log_batch_split(config, mesh: jax.sharding.Mesh) -> None:
  """Logs the mesh and the axes the batch splits over, once the batch size divides over them."""
  sharding = steps.checked_batch_sharding(config, mesh)
  logging.info("mesh %s, batch split over %s", dict(mesh.shape), sharding.spec[0])


def check_plan(config, plan: bvs.Plan, is_main_process: bool) -> bvs.Plan:
  """``plan`` of ``{"params", "opt"}``, once checked (coverage, same on every process, memory)."""
  if is_main_process:
    logging.info("sharding plan:\n%s", plan.report() if _PRINT_PLAN.value else plan.summary())
  if config.max_unsharded_fraction is not None:
    bvs.check_coverage(plan, config.max_unsharded_fraction)
  bvs.check_same_plan(plan)  # Before allocating: every process planned the same.
  memory_gib = config.device_memory_gib
  logging.info("%s", validation.check_memory(plan, jax.local_devices(), memory_gib=memory_gib))
  return plan


def check_compiled(run: build.Run) -> build.Step:
  """``run``'s :class:`build.Step`, once XLA's figure for its compiled train step fits each
  device; else what would fit, compiled to check (trainers/fit.py). Its first line prints the
  start-up's held lines: the checks passed, or the slow ones begin."""
  budget = memory.budget(jax.local_devices(), run.config.device_memory_gib)
  return fit.checked_step(run, budget, log=lambda line: (held.release(), logging.info(line)))


def open_workdir(path: str, config, run, is_main_process: bool):
  """(the run's :class:`checkpoint.Checkpoints`, its metrics writer); process 0 moves an
  earlier run's files aside unless resuming. ``run``: a ``trainers.build.Run`` (its
  optimizer's migration, its plan and the form its state is saved in)."""
  ckpt = checkpoint.Checkpoints(path, config, run.migration, run.plan, run.stored)
  with ckpt.released_on_error():
    latest = ckpt.latest_step()
    newest = ckpt.newest_named_step()  # Not a renamed or empty stray folder's number.
    if newest is not None and newest > config.total_steps:
      raise ConfigError(
          f"config.total_steps={config.total_steps} is below step {newest} of the checkpoint "
          f"in {path}: there is nothing left to train; raise config.total_steps to continue, "
          "or give a new --workdir"
      )
  if is_main_process:
    note = workdir.prepare(path, resuming=latest is not None)
    if note:
      logging.warning("%s", note)
  return ckpt, workdir.MetricsWriter(path)


def note_start(
    path: str, config, begun: start.Start, metrics_path, curves: events.EventWriter, plan
) -> None:
  """Process 0 records where this run starts, with ``plan``'s whole table (and says so when
  it has nothing left to train); metrics.jsonl lines after that step move aside.

  The TensorBoard files move with them, and the records kept are written into a fresh one.
  """
  here = provenance.record_start(path, config.source, begun.step, begun.source)
  provenance.write_text(os.path.join(here, PLAN_TABLE), plan.report())
  logging.info("the sharding plan's table: %s", os.path.join(here, PLAN_TABLE))
  if begun.step >= config.total_steps:
    logging.info(
        "the run in %s finished at step %d of config.total_steps=%d: nothing left to train "
        "(raise config.total_steps to go on)",
        path,
        begun.step,
        config.total_steps,
    )
  moved = workdir.keep_metrics_until(metrics_path, begun.step)
  if moved:
    logging.info("metrics.jsonl lines after step %d moved to %s", begun.step, moved)
    for record in workdir.read_records(metrics_path):
      curves.write(record)


if __name__ == "__main__":
  cli.run(main)
