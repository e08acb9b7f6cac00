"""Durable runs through `python -m trainers.train`, with real orbax checkpoints on disk.

One uninterrupted 8-step run (`reference`, made once: ``tests/trainer/runs.py``) is the
yardstick: runs killed with SIGKILL (at a random step, and during a checkpoint write), then
started again on the same workdir, must log the same losses and end with the same params, bit
for bit. Restores onto other meshes and process counts start from copies of its checkpoints,
and so does each kind of damage (``DAMAGE``), resumed by the trainer and read by
``trainers.sample``, both run in this process. What a resume makes of the state it reads
(other optimizers and dtypes, ``config.model_init``) is tested in ``test_start.py``; SIGTERM in
``test_preemption.py``.
"""

import gc
import json
import os
import pathlib
import random
import resource
import shutil
import signal
import subprocess
import sys
import types
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from tests.helpers import ROOT, metrics
from tests.trainer import runs
from tests.trainer.runs import (
    CONFIG,
    ENV,
    RUN,
    STEPS,
    assert_same_run,
    copy_at,
    finish,
    launch,
    lm_in,
    logged_step,
    saved,
    start,
    train,
    wait_for,
)
from trainers import optimizers
from trainers.rundir import checkpoint, checksums

# The damage tests read arrays from files they altered: orbax's failed reads leave coroutines
# (and an event loop) that Python collects later, during whichever test of this module runs
# then, and pytest reports each as an unraisable exception with its TensorStore spec.
pytestmark = pytest.mark.filterwarnings(
    r"ignore:Exception ignored in:pytest.PytestUnraisableExceptionWarning"
)


@pytest.fixture(scope="module", autouse=True)
def collected():
  """Collects those leftovers before the next module's tests run."""
  yield
  gc.collect()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  return runs.reference(tmp_path_factory)


@pytest.mark.timeout(600)
def test_uninterrupted_run_keeps_latest_and_kept_checkpoints(reference):
  # ckpt_steps=2, keep_ckpt_steps=4: 2 and 6 were deleted once a newer one was complete.
  assert sorted(os.listdir(reference / "checkpoints")) == ["4", "8"]
  assert [r["step"] for r in metrics(reference)] == list(range(1, STEPS + 1))
  start = json.loads((reference / "starts" / "0" / "start.json").read_text())
  assert start["start_step"] == 0 and start["versions"]["orbax-checkpoint"] == "0.12.8"
  assert "git_revision" in start and json.loads((reference / "config.json").read_text())


@pytest.mark.timeout(600)
def test_kill_at_a_random_step_then_resume_is_exact(tmp_path, reference):
  workdir, at = tmp_path / "run", random.randint(3, STEPS - 1)
  proc = start(workdir)
  ckpts = workdir / "checkpoints"
  complete = lambda: ckpts.exists() and any(n.isdigit() for n in os.listdir(ckpts))
  wait_for(lambda: logged_step(workdir) >= at and complete(), proc, every=0.01)
  proc.kill()
  finish(proc)
  logged = logged_step(workdir)
  out = train(workdir)
  resumed = int(out.split("resumed at step ")[1].split()[0])
  assert resumed <= logged and f"checkpoints/{resumed} " in out, (at, out[-3000:])
  if logged > resumed:  # The dead attempt's lines after the checkpoint were moved, not lost.
    moved = (workdir / "attempt-1" / "metrics.jsonl").read_text().splitlines()
    assert json.loads(moved[0])["step"] == resumed + 1 and len(moved) >= logged - resumed
  assert_same_run(workdir, reference)


@pytest.mark.timeout(600)
def test_kill_during_a_checkpoint_write_uses_the_previous_one(tmp_path, reference):
  workdir = tmp_path / "run"
  ckpts = workdir / "checkpoints"
  proc = start(workdir, "--config.ckpt_steps=1")

  def writing():  # The loop runs ahead of the writes (saves do not stall it): ask for both.
    names = os.listdir(ckpts) if ckpts.exists() else []
    return any("tmp" in n for n in names) and any(n.isdigit() for n in names)

  wait_for(writing, proc)
  proc.kill()
  finish(proc)
  cut = [n for n in os.listdir(ckpts) if "tmp" in n]
  complete = sorted(int(n) for n in os.listdir(ckpts) if n.isdigit())
  assert cut and complete, os.listdir(ckpts)  # The kill cut a write short; an older one is whole.
  out = train(workdir, "--config.ckpt_steps=1")
  assert f"resumed at step {complete[-1]} from {ckpts}/{complete[-1]} " in out, out[-3000:]
  assert not any("tmp" in n for n in os.listdir(ckpts))
  assert_same_run(workdir, reference)


@pytest.mark.timeout(900)
def test_restore_across_meshes_and_process_counts(tmp_path, reference):
  """8 devices -> mesh (4, 2) -> 2 processes x 4 -> 2 devices -> 1 device, one step each."""
  workdir = copy_at(reference, tmp_path / "run", 4)
  want = {r["step"]: r["loss"] for r in metrics(reference)}
  hops = [
      (5, lambda: train(workdir, "--config.mesh=(('data', 4), ('model', 2))", total=5)),
      (6, lambda: launch(workdir, total=6)),
      (7, lambda: train(workdir, "--devices_per_process=2", total=7)),
      (8, lambda: train(workdir, "--devices_per_process=1", total=8)),
  ]
  for step, hop in hops:
    out = hop()
    assert f"resumed at step {step - 1} from" in out, out[-3000:]
    assert "state shardings match the plan after restore" in out
    # A step on the restored values: the loss the 8-device run logged (up to reduction order).
    assert metrics(workdir)[-1]["loss"] == pytest.approx(want[step], rel=1e-5)
  assert [r["step"] for r in metrics(workdir)] == list(range(1, STEPS + 1))


# Eval at every step, checkpoints only at steps 20 and 40.


@pytest.mark.timeout(300)
def test_checkpoint_of_another_model_fails_before_anything_is_written(tmp_path, reference):
  workdir = copy_at(reference, tmp_path / "run", STEPS)
  before = (workdir / "metrics.jsonl").read_text()
  listing = sorted(os.listdir(workdir / "checkpoints"))
  status, out = finish(start(workdir, "--config.model.size=small"))
  assert status != 0 and "CheckpointMismatchError" in out, out[-3000:]
  assert f"checkpoint {workdir}/checkpoints/{STEPS} is of another model: params/" in out
  assert out.count("CheckpointMismatchError: ") == 1
  assert (workdir / "metrics.jsonl").read_text() == before
  assert sorted(os.listdir(workdir / "checkpoints")) == listing
  assert sorted(os.listdir(workdir / "starts")) == ["0"] and "resumed at step" not in out


@pytest.mark.timeout(300)
def test_a_resume_with_total_steps_below_the_checkpoint_fails_before_anything_is_written(
    tmp_path, reference
):
  workdir = copy_at(reference, tmp_path / "run", STEPS)
  before = (workdir / "metrics.jsonl").read_text()
  status, out = finish(start(workdir, total=STEPS - 2))
  assert status == 1, out[-3000:]
  assert out.splitlines()[-1] == (
      f"ConfigError: config.total_steps={STEPS - 2} is below step {STEPS} of the checkpoint in "
      f"{workdir}: there is nothing left to train; raise config.total_steps to continue, or give "
      "a new --workdir"
  )
  assert (workdir / "metrics.jsonl").read_text() == before
  assert sorted(os.listdir(workdir / "starts")) == ["0"]


@pytest.mark.timeout(300)
def test_a_finished_run_started_again_says_so_and_exits_0(tmp_path, reference):
  workdir = copy_at(reference, tmp_path / "run", STEPS)
  before = (workdir / "metrics.jsonl").read_text()
  status, out = finish(start(workdir, total=STEPS))
  assert status == 0, out[-3000:]
  assert (
      f"the run in {workdir} finished at step {STEPS} of config.total_steps={STEPS}: nothing "
      "left to train (raise config.total_steps to go on)"
  ) in out
  assert (workdir / "metrics.jsonl").read_text() == before


@pytest.mark.timeout(300)
def test_unwritable_workdir_fails_before_training(tmp_path):
  blocker = tmp_path / "a_file"
  blocker.write_text("")
  status, out = finish(start(blocker / "run", log=tmp_path / "log"))
  assert status != 0
  assert f"--workdir={blocker}/run: {blocker} is a file, not a directory" in out, out[-3000:]
  assert "ConfigError" in out
  assert "initialising params" not in out


def flip_bytes(path: pathlib.Path, count: int = 64) -> None:
  """Inverts ``count`` bytes in the middle of file ``path`` (the disk's damage)."""
  data = bytearray(path.read_bytes())
  middle = len(data) // 2
  data[middle : middle + count] = bytes(b ^ 0xFF for b in data[middle : middle + count])
  path.write_bytes(bytes(data))


def largest_data_file(step_dir: pathlib.Path, item: str) -> pathlib.Path:
  return max((step_dir / item).rglob("d/*"), key=lambda p: p.stat().st_size)


def edit_meta(step_dir: pathlib.Path, *remove: str, **put) -> None:
  """Removes keys ``remove`` from the meta item of checkpoint ``step_dir`` and sets ``put``."""
  path = step_dir / "meta" / "metadata"
  meta = {k: v for k, v in json.loads(path.read_text()).items() if k not in remove}
  path.write_text(json.dumps({**meta, **put}))


def strip_sums(step_dir: pathlib.Path, change_data: bool = False) -> None:
  """Removes the checksums from checkpoint ``step_dir``'s meta (it still records their
  format), and with ``change_data`` inverts bytes of its largest params data file after."""
  edit_meta(step_dir, checksums.SUMS)
  if change_data:
    flip_bytes(largest_data_file(step_dir, "params"))


class Damage(NamedTuple):
  """One kind of damage to a workdir holding steps 4 and 8 (``make(checkpoints)``): the folder
  it leaves that does not check out, what a read of it says, the step a resume starts from and
  the newest step whose params check out (``load_params`` reads params only: damage to the opt
  state is not its to see)."""

  make: Callable[[pathlib.Path], None]
  folder: str
  says: str
  resumes: int
  params: int


DAMAGE = {
    "bits in a params file": Damage(
        lambda ckpts: flip_bytes(largest_data_file(ckpts / "8", "params")),
        "8",
        ": params/",  # ... <leaf> does not match the checksum saved with it
        4,
        4,
    ),
    "bits in an opt file": Damage(
        lambda ckpts: flip_bytes(largest_data_file(ckpts / "8", "opt")), "8", ": opt/", 4, 8
    ),
    "a renamed step folder": Damage(
        lambda ckpts: os.rename(ckpts / "8", ckpts / "12"),
        "12",
        " holds step 8: its folder was renamed",
        4,
        4,
    ),
    "an empty stray step folder": Damage(
        lambda ckpts: (ckpts / "12").mkdir(), "12", " cannot be read (", 8, 8
    ),
    "sums removed from the meta": Damage(
        lambda ckpts: strip_sums(ckpts / "8"),
        "8",
        ": its meta records checksum format 2 but no checksum of ",
        4,
        4,
    ),
    "sums removed from the meta, then bits in a params file": Damage(
        lambda ckpts: strip_sums(ckpts / "8", change_data=True),
        "8",
        ": its meta records checksum format 2 but no checksum of ",
        4,
        4,
    ),
    "a truncated metadata file": Damage(
        lambda ckpts: (ckpts / "8" / "params" / "_METADATA").write_text(
            (ckpts / "8" / "params" / "_METADATA").read_text()[:40]
        ),
        "8",
        " cannot be read (",
        4,
        4,
    ),
}


def damaged_copy(reference, workdir, damage: str | None):
  """A copy of the reference workdir with its steps 4 and 8, damaged by ``DAMAGE[damage]``
  (None: not yet)."""
  copy_at(reference, workdir, 8)
  shutil.copytree(reference / "checkpoints" / "4", workdir / "checkpoints" / "4")
  if damage is not None:
    DAMAGE[damage].make(workdir / "checkpoints")
  return workdir


def train_here(workdir, caplog, *overrides, total=STEPS) -> str:
  """``python -m trainers.train`` with ``RUN``, in this process (no interpreter to start, the
  programs compiled already in memory or in the session's cache): its log (INFO and up)."""
  from absl import flags

  from trainers import train as trainer
  from trainers.settings import cli

  argv = ["train", f"--workdir={workdir}", f"--config={CONFIG}", *RUN]
  argv += [f"--config.total_steps={total}", *overrides]
  on_sigterm, on_argv = signal.getsignal(signal.SIGTERM), sys.argv
  sys.argv = argv  # Where the --config.key=value overrides are read from.
  caplog.clear()
  try:
    cli.parse_flags(argv)
    caplog.set_level("INFO", logger="absl")
    cli.command(trainer.main)(argv)
  finally:
    sys.argv = on_argv
    signal.signal(signal.SIGTERM, on_sigterm)  # The run's Preemption handler.
    flags.FLAGS.unparse_flags()
    for name in [name for name in flags.FLAGS if name.startswith("config.")]:
      delattr(flags.FLAGS, name)  # Each run defines the overrides it names.
  return caplog.text


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_step_is_never_loaded_and_the_previous_good_one_is(tmp_path, reference, damage):
  """As ``trainers.sample`` and ``config.model_init`` read params (``load_params``)."""
  workdir = damaged_copy(reference, tmp_path / "run", damage)
  run = lm_in("float32")
  with jax.set_mesh(run.mesh):
    params, source = checkpoint.load_params(str(workdir), run.plan)
  good = DAMAGE[damage].params
  assert source == f"{workdir}/checkpoints/{good}"
  same = jax.tree.map(lambda a, b: np.array_equal(np.asarray(a), b), params, saved(reference, good))
  assert all(jax.tree.leaves(same))
  newest = max(int(n) for n in os.listdir(workdir / "checkpoints") if n.isdigit())
  if newest != good:  # Named, the damaged step is refused in one error naming it.
    with pytest.raises(checkpoint.DamagedCheckpointError, match=f"checkpoints/{newest}"):
      checkpoint.load_params(str(workdir / "checkpoints" / str(newest)), run.plan)


def flip_bit(path: pathlib.Path) -> None:
  """Flips one bit in the middle of file ``path``."""
  data = bytearray(path.read_bytes())
  data[len(data) // 2] ^= 0x10
  path.write_bytes(bytes(data))


def swap_words(path: pathlib.Path) -> None:
  """Swaps two different 4-byte words 64 bytes apart in the middle of file ``path`` (in an
  uncompressed data file: two elements, or parts of them, trade places)."""
  data = bytearray(path.read_bytes())
  i = len(data) // 2
  while data[i : i + 4] == data[i + 64 : i + 68]:
    i += 4
  data[i : i + 4], data[i + 64 : i + 68] = data[i + 64 : i + 68], data[i : i + 4]
  path.write_bytes(bytes(data))


def truncate(path: pathlib.Path) -> None:
  path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


# The least damage to step 8's largest params data file that a read must still find.
LEAST_DAMAGE = {"one flipped bit": flip_bit, "two swapped words": swap_words, "a cut": truncate}


@pytest.mark.parametrize("damage", LEAST_DAMAGE)
def test_the_least_damage_to_a_params_file_is_found(tmp_path, reference, caplog, damage):
  workdir = damaged_copy(reference, tmp_path / "run", None)
  LEAST_DAMAGE[damage](largest_data_file(workdir / "checkpoints" / "8", "params"))
  run = lm_in("float32")
  with jax.set_mesh(run.mesh):
    _, source = checkpoint.load_params(str(workdir), run.plan)
  assert source == f"{workdir}/checkpoints/4"
  assert f"checkpoint {workdir}/checkpoints/8" in caplog.text


UNVERIFIED = "records no checksums (saved before they were written): its arrays cannot be verified"


def format_1_sums(workdir, step: int) -> dict[str, int]:
  """Checkpoint ``step``'s sums as a save before format 2 wrote them (format 1)."""
  return {
      f"{item}/{leaf}": s
      for item in ("params", "opt")
      for leaf, s in checksums.of(jax.tree.map(jnp.asarray, saved(workdir, step, item)), 1).items()
  }


@pytest.mark.parametrize("saved_with", ["format 1 sums", "no sums"])
def test_checkpoints_saved_before_format_2_are_checked_as_saved(
    tmp_path, reference, caplog, saved_with
):
  """A meta without "sums_format" holds format 1 checksums (bit patterns times 2 i + 1): they
  are checked in that format; one without "sums" either (saved before checksums) is read as
  it is, with one warning line each time it is read."""
  workdir = damaged_copy(reference, tmp_path / "run", None)
  for step in (4, 8):
    sums = {"sums": format_1_sums(workdir, step)} if saved_with == "format 1 sums" else {}
    edit_meta(workdir / "checkpoints" / str(step), "sums", "sums_format", **sums)
  run = lm_in("float32")
  caplog.set_level("WARNING", logger="absl")
  with jax.set_mesh(run.mesh):
    assert checkpoint.load_params(str(workdir), run.plan)[1].endswith("checkpoints/8")
    warned = caplog.text.count(UNVERIFIED)
    flip_bytes(largest_data_file(workdir / "checkpoints" / "8", "params"))
    _, source = checkpoint.load_params(str(workdir), run.plan)
  assert source == f"{workdir}/checkpoints/{4 if saved_with == 'format 1 sums' else 8}"
  assert warned == (0 if saved_with == "format 1 sums" else 1), caplog.text
  if saved_with == "no sums":
    assert f"checkpoint {workdir}/checkpoints/8 {UNVERIFIED}" in caplog.text


@pytest.mark.timeout(300)
def test_the_trainer_resumes_a_checkpoint_saved_before_checksums_with_one_warning(
    tmp_path, reference, caplog
):
  """Neither sums nor their format: the resume reads params and opt state unchecked, says so
  in one line naming the step, and ends as the uninterrupted run."""
  workdir = copy_at(reference, tmp_path / "run", 4)
  edit_meta(workdir / "checkpoints" / "4", "sums", "sums_format")
  out = train_here(workdir, caplog)
  assert out.count(UNVERIFIED) == 1, out[-3000:]
  assert f"checkpoint {workdir}/checkpoints/4 {UNVERIFIED}" in out
  assert f"resumed at step 4 from {workdir}/checkpoints/4 " in out
  assert_same_run(workdir, reference)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("damage", DAMAGE)
def test_the_trainer_resumes_from_the_newest_step_that_checks_out_and_says_why(
    tmp_path, reference, caplog, damage
):
  workdir = damaged_copy(reference, tmp_path / "run", damage)
  ckpts, kind = workdir / "checkpoints", DAMAGE[damage]
  out = train_here(workdir, caplog)
  assert f"checkpoint {ckpts}/{kind.folder}{kind.says}" in out, out[-3000:]
  assert f"resumed at step {kind.resumes} from {ckpts}/{kind.resumes} " in out
  assert_same_run(workdir, reference)
  assert (ckpts / f"damaged-{kind.folder}").is_dir()  # Moved aside, not deleted.


@pytest.mark.timeout(300)
def test_the_trainer_stops_in_one_line_when_no_step_checks_out(tmp_path, reference, caplog, capsys):
  workdir = damaged_copy(reference, tmp_path / "run", "bits in a params file")
  flip_bytes(largest_data_file(workdir / "checkpoints" / "4", "params"))
  before = (workdir / "metrics.jsonl").read_text()
  with pytest.raises(SystemExit) as exited:
    train_here(workdir, caplog)
  err = capsys.readouterr().err
  assert exited.value.code == 1 and err.splitlines() == [err.strip()], err
  assert err.startswith(
      f"DamagedCheckpointError: no checkpoint in {workdir}/checkpoints checks out ("
  ), err
  assert (workdir / "metrics.jsonl").read_text() == before


@pytest.mark.timeout(300)
@pytest.mark.parametrize("damage", DAMAGE)
def test_sampling_falls_back_to_the_newest_params_that_check_out_and_says_why(
    tmp_path, reference, caplog, capsys, damage
):
  """``python -m trainers.sample``, in this process, on each damaged copy."""
  from trainers import sample

  workdir = damaged_copy(reference, tmp_path / "run", damage)
  ckpts, kind = workdir / "checkpoints", DAMAGE[damage]
  listed = sorted(os.listdir(ckpts))
  caplog.set_level("WARNING", logger="absl")
  sample.main([f"--workdir={workdir}", "--prompt=the", "--max_new_tokens=1", "--temperature=0"])
  err = capsys.readouterr().err
  assert f"sampling from {ckpts}/{kind.params} on 8 devices" in err, err
  if kind.folder != str(kind.params):  # Damage to the opt state is not sampling's to see.
    assert f"checkpoint {ckpts}/{kind.folder}{kind.says}" in caplog.text, caplog.text
    assert "trying the previous checkpoint" in caplog.text
  assert sorted(os.listdir(ckpts)) == listed  # Sampling moves nothing.


def no_room_to_write(limit: int = 200_000):
  """In a child before it runs: files cannot grow past ``limit`` bytes (writes then fail with
  EFBIG, as on a full disk with ENOSPC), without the signal that would kill it."""
  signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
  resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))


def test_a_write_that_finds_no_room_is_one_line(tmp_path, monkeypatch):
  """The room is checked before each save (above); a disk that fills during the write gives
  the same line from the error orbax raises (ENOSPC here, as TensorStore reports it)."""
  config = ml_collections.ConfigDict(dict(total_steps=STEPS, ckpt_steps=2, keep_ckpt_steps=None))
  ckpt = checkpoint.Checkpoints(str(tmp_path), config, optimizers.BuiltOptimizer("adamw", {}))
  ckpt.state_bytes = 3 * 2**20
  monkeypatch.setattr(shutil, "disk_usage", lambda path: types.SimpleNamespace(free=2**20))
  with pytest.raises(checkpoint.CheckpointWriteError, match="would fail: no space left on device"):
    ckpt.check_room()
  with pytest.raises(checkpoint.CheckpointWriteError) as raised, ckpt.writing():
    raise OSError(28, "No space left on device")
  assert str(raised.value) == (
      f"saving a checkpoint into {tmp_path}/checkpoints failed: no space left on device (errno "
      "28). A checkpoint of this state needs about 3.0 MiB there: free it, or give another "
      "--workdir (the last checkpoint, no checkpoint was completed yet)"
  )


# preexec_fn makes subprocess fork (jax warns, its threads being up here); the child only limits
# its file size, ignores SIGXFSZ and execs the trainer, touching none of jax.
@pytest.mark.filterwarnings(r"ignore:os\.fork\(\) was called:RuntimeWarning")
@pytest.mark.timeout(300)
def test_a_save_that_finds_no_room_is_one_line_and_the_last_checkpoint_resumes(tmp_path, reference):
  workdir = copy_at(reference, tmp_path / "run", 4)
  cmd = [sys.executable, "-m", "trainers.train", f"--workdir={workdir}", f"--config={CONFIG}", *RUN]
  done = subprocess.run(
      [*cmd, f"--config.total_steps={STEPS}"],
      cwd=ROOT,
      env=ENV,
      capture_output=True,
      text=True,
      preexec_fn=no_room_to_write,
      timeout=240,
  )
  assert done.returncode == 1, done.stderr[-3000:]
  assert done.stderr.splitlines()[-1] == (
      f"CheckpointWriteError: saving a checkpoint into {workdir}/checkpoints would fail (this "
      "process's file size limit: 200000 bytes): file too large (errno 27). A checkpoint of this "
      "state needs about 3.2 MiB there: free it, or give another --workdir (the last "
      "checkpoint, step 4 is intact)"
  )
  assert "Traceback" not in done.stderr  # Checked before orbax starts a write that would fail.
  train(workdir)  # Room again: it resumes from step 4 and ends as the uninterrupted run.
  assert_same_run(workdir, reference)
