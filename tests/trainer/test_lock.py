"""trainers/rundir/lock.py on local workdirs: one run at a time, a clean end leaves no lock file,
a dead run's lock is taken over naming it, and a ``.lock`` that is not a regular file is refused
in one line before anything is written (a link's target untouched, a FIFO never waited on)."""

import fcntl
import os
import socket
import subprocess
import sys

import pytest

from tests.helpers import EARLIER, ROOT, quick_lm, train, used_workdir
from trainers.errors import ConfigError
from trainers.rundir import lock

FIX = "remove it, or give this run another --workdir"


def refused(workdir, take, fragment: str) -> str:
  """The one ``ConfigError`` line of ``take`` (check_free or hold) on ``workdir``."""
  with pytest.raises(ConfigError) as raised:
    take(str(workdir))
  message = str(raised.value)
  assert "\n" not in message and fragment in message and FIX in message, message
  assert f"{workdir}/.lock is " in message, message
  return message


@pytest.mark.parametrize("take", [lock.check_free, lock.hold], ids=["check_free", "hold"])
def test_a_symlink_lock_is_refused_and_its_target_is_untouched(tmp_path, take):
  outside = tmp_path / "outside.txt"
  outside.write_bytes(b"precious\n")
  workdir = tmp_path / "run"
  workdir.mkdir()
  (workdir / ".lock").symlink_to(outside)
  refused(workdir, take, f"a symbolic link (to {outside})")
  assert outside.read_bytes() == b"precious\n"
  assert os.listdir(workdir) == [".lock"] and (workdir / ".lock").is_symlink()


@pytest.mark.parametrize("take", [lock.check_free, lock.hold], ids=["check_free", "hold"])
def test_a_dangling_symlink_lock_is_refused_and_nothing_is_created(tmp_path, take):
  missing = tmp_path / "missing"
  workdir = tmp_path / "run"
  workdir.mkdir()
  (workdir / ".lock").symlink_to(missing)
  refused(workdir, take, f"a symbolic link (to {missing}, which does not exist)")
  assert not missing.exists() and not os.path.lexists(missing)


@pytest.mark.timeout(20)
@pytest.mark.parametrize("take", [lock.check_free, lock.hold], ids=["check_free", "hold"])
def test_a_fifo_lock_is_refused_at_once(tmp_path, take):
  os.mkfifo(tmp_path / ".lock")
  refused(tmp_path, take, "a named pipe (FIFO)")


@pytest.mark.parametrize("take", [lock.check_free, lock.hold], ids=["check_free", "hold"])
def test_a_directory_lock_is_refused(tmp_path, take):
  (tmp_path / ".lock").mkdir()
  refused(tmp_path, take, "a directory")
  assert os.listdir(tmp_path / ".lock") == []


@pytest.mark.parametrize("take", [lock.check_free, lock.hold], ids=["check_free", "hold"])
def test_a_socket_lock_is_refused(tmp_path, take):
  with socket.socket(socket.AF_UNIX) as listening:
    listening.bind(str(tmp_path / ".lock"))
    refused(tmp_path, take, "a socket")


def test_a_lock_file_that_is_not_utf8_is_taken_over_with_a_warning(tmp_path):
  (tmp_path / ".lock").write_bytes(b"\xff\xfe not text\n")
  lock.check_free(str(tmp_path))  # No process holds it: free.
  held = lock.hold(str(tmp_path))
  assert held.earlier == {"unreadable": "not valid UTF-8"}
  assert held.took_over() == (
      f"--workdir={tmp_path}: took over a lock file that names no run (not valid UTF-8); "
      "no live process held it"
  )
  held.release()
  assert not os.path.lexists(tmp_path / ".lock")


def test_a_held_lock_file_that_is_not_json_refuses_in_one_line(tmp_path):
  (tmp_path / ".lock").write_bytes(b"\xff garbage")
  with open(tmp_path / ".lock", "rb") as other:  # Another open file: another run's lock.
    fcntl.flock(other, fcntl.LOCK_EX)
    with pytest.raises(ConfigError) as raised:
      lock.hold(str(tmp_path))
  assert str(raised.value) == (
      f"--workdir={tmp_path} is in use by another run (its lock file names no run: not valid "
      "UTF-8): wait for it to end, or give this run another --workdir"
  )
  assert (tmp_path / ".lock").read_bytes() == b"\xff garbage"


def test_a_released_lock_leaves_no_file_and_the_next_run_takes_it_fresh(tmp_path):
  held = lock.hold(str(tmp_path / "run"))
  assert (tmp_path / "run" / ".lock").is_file()
  held.release()
  held.release()  # Twice: nothing more.
  assert os.listdir(tmp_path / "run") == []
  again = lock.hold(str(tmp_path / "run"))
  assert again.earlier is None and again.took_over() is None
  again.release()


def test_a_run_that_ends_with_an_error_leaves_no_lock_file(tmp_path):
  code = (
      "import sys; from trainers.rundir import lock; from trainers.errors import ConfigError\n"
      "held = lock.hold(sys.argv[1])\n"
      "raise ConfigError('a mistake of ours')"
  )
  done = subprocess.run(
      [sys.executable, "-c", code, str(tmp_path)], cwd=ROOT, capture_output=True, timeout=60
  )
  assert done.returncode == 1 and b"a mistake of ours" in done.stderr
  assert os.listdir(tmp_path) == []  # Released at interpreter exit.


def test_the_lock_of_a_killed_run_is_taken_over_and_names_it(tmp_path):
  code = (
      "import sys, time; from trainers.rundir import lock\n"
      "held = lock.hold(sys.argv[1]); print(1, flush=True); time.sleep(600)"
  )
  holder = subprocess.Popen(
      [sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, cwd=ROOT, text=True
  )
  assert holder.stdout.readline() == "1\n"
  with pytest.raises(ConfigError, match=f"process {holder.pid} on"):
    lock.hold(str(tmp_path))
  holder.kill()  # kill -9: the kernel frees its lock, its file stays.
  holder.wait()
  held = lock.hold(str(tmp_path))
  assert held.earlier["pid"] == holder.pid
  assert held.took_over().startswith(
      f"--workdir={tmp_path}: took over the lock of a run that died (process {holder.pid} on "
  )
  assert held.took_over().endswith(
      "that process is gone, killed or crashed before it released its lock"
  )
  held.release()
  lock.check_free(str(tmp_path))


def test_a_second_run_on_a_held_workdir_stops_in_one_line_naming_the_holder(tmp_path):
  workdir = used_workdir(tmp_path / "run")
  held = lock.hold(str(workdir))  # This process: the run that is using the workdir.
  status, out, _ = train(workdir, timeout=120)
  assert status == 1 and "Traceback" not in out, out
  line = next(x for x in out.splitlines() if x.startswith("ConfigError:"))
  assert f"is in use by another run (process {os.getpid()} on " in line
  assert "give this run another --workdir" in line
  assert all((workdir / n).read_bytes() == c for n, c in EARLIER.items())
  held.release()


def test_a_trainer_on_a_symlink_lock_exits_in_one_line_and_a_clean_run_leaves_no_lock(tmp_path):
  outside = tmp_path / "outside.txt"
  outside.write_bytes(b"precious\n")
  workdir = tmp_path / "run"
  workdir.mkdir()
  (workdir / ".lock").symlink_to(outside)
  status, out, _ = train(workdir, *quick_lm(2, 1, 1000, 1), timeout=120)
  assert status == 1 and "Traceback" not in out, out
  line = next(x for x in out.splitlines() if x.startswith("ConfigError:"))
  assert line == (
      f"ConfigError: --workdir={workdir}: {workdir}/.lock is a symbolic link (to {outside}), "
      f"not a lock file: {FIX}"
  )
  assert outside.read_bytes() == b"precious\n" and os.listdir(workdir) == [".lock"]
  (workdir / ".lock").unlink()
  (workdir / ".lock").write_text('{"pid": 4242, "host": "gone", "since": "then"}\n')
  status, out, _ = train(workdir, *quick_lm(2, 1, 1000, 1), timeout=240)
  assert status == 0, out[-3000:]
  assert "took over the lock of a run that died (process 4242 on gone, since then)" in out
  assert not os.path.lexists(workdir / ".lock")


def test_a_lock_file_deleted_by_its_run_after_another_opened_it_is_not_taken(tmp_path):
  """A run that opened the lock file just before its holder released (deleted) it finds, once it
  locks it, that the file is gone from the workdir: hold then opens a fresh one."""
  held = lock.hold(str(tmp_path))
  opened = lock._open(str(tmp_path), create=True)  # The same file, opened by the next run.
  held.release()
  try:
    assert lock._taken(opened, str(tmp_path)) is None
  finally:
    os.close(opened)
  again = lock.hold(str(tmp_path))
  assert again.earlier is None and (tmp_path / ".lock").is_file()
  again.release()
