"""One run per workdir: the run holds a lock on it for as long as it lives.

A local workdir's lock is an advisory ``flock`` on ``<workdir>/.lock``, a file that names its
holder (host, process id, start time). The kernel releases the lock when the holder exits, by
any means (``kill -9`` included). A run that ends, cleanly or with an error, deletes its file
(:meth:`Held.release`, also at interpreter exit), so a ``.lock`` that stays is a dead run's: a
run that was killed or crashed. The next run takes it over and says whose it was. A run
deletes its file while it still holds the lock, so a run that opened the file just before finds,
once it holds the lock, that the file is no longer at ``.lock``, and opens it again: two runs
never hold locks on two files.
:func:`check_free` only looks (it writes nothing, so a run whose config fails its checks leaves
the workdir as it was); :func:`hold` takes the lock, once every check has passed. Either raises
``ConfigError`` naming the holder while another run lives.

The lock file is opened with ``O_NOFOLLOW | O_NONBLOCK`` (and created with ``O_CREAT | O_EXCL``)
and checked with ``fstat`` before it is read or written, so it is never written through a link
and never blocks on a pipe. A ``.lock`` that is not a regular file (a symbolic link, dangling or
not, a FIFO, a directory, a socket) is refused with one ``ConfigError`` naming it, before
anything is written; a link's target is not touched. A lock file whose content is not valid
UTF-8 or not JSON names no holder, and is taken over with a warning that says so: on a local
workdir the ``flock``, not the content, tells whether a run lives, so a free lock protects
nothing, and refusing it would only make the user delete it by hand. While a live run holds
it, the refusal says the file names no run.

A ``gs://`` workdir's lock is the object ``<workdir>/.lock``, naming its holder the same way (in
its custom metadata; its body repeats it for people), held by a lease (:class:`Lease`): a daemon
thread rewrites the object every quarter of ``lease_s`` (:data:`LEASE_S`, 60 s: every 15 s, one
small object write, off the training loop), and a lock not rewritten for ``lease_s`` is the lock
of a run that is gone. Its age is the server's alone: the ``Date`` of the reply that reads it
less the object's ``updated`` time, both Google's clock, so no host's clock matters (``Date``
has whole seconds: an age reads at most 1 s short, which only errs toward a live lease). A clean
exit (:meth:`Lease.release`, also at interpreter exit) deletes the object; a killed run's object
stays until its lease lapses, then the next run takes it over, saying whose it was. The lease is
the holder's (it is in the object), so a run with a short ``--workdir_lease`` is taken over
sooner.

Why two runs never both hold a gs:// lock: every write of the object is conditional on the
generation its writer last read (GCS's ``ifGenerationMatch``; GCS applies a write only if the
object's generation is still that one, else answers 412 Precondition Failed), and every write
makes a new generation. Taking a free workdir creates the object with ``ifGenerationMatch=0``
(only if absent: of runs racing, one creates it). Taking over a lapsed lock overwrites it with
``ifGenerationMatch=G``, ``G`` the lapsed object's generation: the first such write makes a new
generation, so every other write conditional on ``G`` (a second taker's, or a late renewal of
the holder that stalled past its lease) fails; a taker that fails reads again and finds the
winner's live lease (the ``ConfigError`` naming it). A renewal is conditional on the holder's own
last generation, so a holder whose lock was taken over learns it at its next renewal: it logs an
error, stops renewing and deletes nothing at release. Deletion too is conditional on the
holder's generation, so it never deletes another run's lock. A write whose reply was lost and
that gcsfs sent again answers 412 although it landed: the random ``token`` in each holder's
record tells that holder it is its own write.

Example:
  >>> import tempfile
  >>> run = tempfile.mkdtemp()
  >>> first = hold(run)
  >>> check_free(run)
  Traceback (most recent call last):
  ...
  bv_sharding.errors.ConfigError: --workdir=... is in use by another run (process ... on ..., since ...): wait for it to end, or give this run another --workdir
  >>> first.release()
  >>> check_free(run)  # free again: the next run may take it
  >>> os.path.exists(os.path.join(run, LOCK))  # a run that ends leaves no lock file
  False
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import email.utils
import fcntl
import json
import os
import socket
import stat
import threading
import urllib.parse
import uuid

from absl import logging

from trainers.errors import ConfigError
from trainers.rundir import paths

LOCK = ".lock"
LEASE_S = 60.0  # A gs:// lock's lease, renewed every quarter of it: a killed run's lapses so.
TRIES = 5  # Reads and conditional writes before hold gives up on a gs:// lock changing hands.


@dataclasses.dataclass
class Held:
  """A held local workdir lock: the open lock file ``fd`` in workdir ``path``.

  :meth:`release` deletes the file and frees the lock (also at interpreter exit). ``earlier``:
  the holder named in the lock file it took over (a run that died), else None;
  ``{"unreadable": why}`` if that file named no holder.

  Example:
    >>> import tempfile
    >>> held = hold(tempfile.mkdtemp())
    >>> held.took_over() is None  # No run had held this workdir.
    True
    >>> held.release()
  """

  fd: int | None
  path: str
  earlier: dict | None = None

  def __post_init__(self):
    atexit.register(self.release)

  def release(self) -> None:
    """Deletes the lock file if it is still this run's, then closes it (freeing the lock)."""
    fd, self.fd = self.fd, None
    atexit.unregister(self.release)
    if fd is None:
      return
    lock = os.path.join(self.path, LOCK)
    try:
      if _same(fd, lock):
        os.unlink(lock)  # While locked: a run that opens it now finds it gone and retries.
    except OSError as error:
      logging.warning("could not delete the lock file %s (%s)", lock, error)
    finally:
      os.close(fd)

  def check(self) -> None:
    """Nothing: a local lock lives as long as its holder (see :meth:`Lease.check`)."""

  def took_over(self) -> str | None:
    """The warning for the dead run's lock this run took over, or None if there was none."""
    if self.earlier is None:
      return None
    if "unreadable" in self.earlier:
      return (
          f"--workdir={self.path}: took over a lock file that names no run "
          f"({self.earlier['unreadable']}); no live process held it"
      )
    return (
        f"--workdir={self.path}: took over the lock of a run that died ({_named(self.earlier)}): "
        "that process is gone, killed or crashed before it released its lock"
    )


class Lease:
  """A held ``gs://`` workdir lock: a daemon thread renews its lease every quarter of
  ``lease_s`` until :meth:`release` (also run at interpreter exit) deletes the object.

  ``earlier``: the holder of the lapsed lock it took over, else None. ``lost``: the holder that
  took this run's lock over (this run's renewals failed for a whole lease), else None.
  """

  def __init__(self, url: str, record: dict, generation: str, earlier: dict | None):
    self.url, self.record, self.generation, self.earlier = url, record, generation, earlier
    self.lost: dict | None = None
    self._stop, self._writing = threading.Event(), threading.Lock()
    self._thread = threading.Thread(target=self._renew, name="workdir-lease", daemon=True)
    self._thread.start()
    atexit.register(self.release)

  def release(self) -> None:
    self._stop.set()
    with self._writing:  # After a renewal in flight: the generation to delete is its.
      generation, self.generation = self.generation, None
    atexit.unregister(self.release)
    if generation is None or self.lost is not None:
      return  # Released already, or another run's lock now: not this run's to delete.
    try:
      _delete(self.url, generation)
    except (FileNotFoundError, FileExistsError):
      pass  # Gone, or taken over since: not this run's to delete.
    except Exception as error:  # The object stays, and lapses with its lease.
      logging.warning("could not delete the lock on --workdir=%s (%s)", self.url, error)

  def check(self) -> None:
    """Raises ``ConfigError`` naming the run that took this lock over, if one did: the run
    then saves nothing more (the loop checks before every save)."""
    if self.lost is not None:
      taker = _named(self.lost) if self.lost else "its object was deleted"
      raise ConfigError(
          f"--workdir={self.url} was taken over by another run ({taker}) after this run's lease "
          "lapsed: this run stops without saving; give one of the two runs another --workdir"
      )

  def took_over(self) -> str | None:
    """The warning for the lapsed lock this run took over, or None if there was none."""
    if self.earlier is None:
      return None
    lease_s = float(self.earlier.get("lease_s", LEASE_S))
    return (
        f"--workdir={self.url}: took over the lock of a run that stopped renewing it "
        f"({_named(self.earlier)}): its {lease_s:g} s lease lapsed, so that run was killed, "
        "lost its machine or hung"
    )

  def _renew(self) -> None:
    while not self._stop.wait(float(self.record["lease_s"]) / 4):
      with self._writing:
        if self.generation is None:
          return
        try:
          self.generation = _write(self.url, self.record, self.generation)
        except FileExistsError:  # 412: the object is not at this run's generation any more.
          found = _read(self.url)
          if found is not None and found.holder.get("token") == self.record["token"]:
            self.generation = found.generation  # This write landed; its reply was lost.
            continue
          self.lost = found.holder if found is not None else {}
          logging.error(
              "the lock on --workdir=%s is lost (%s): this run did not renew its lease for "
              "%s s, and its writes now race the new holder's; stop one of the two runs",
              self.url,
              _named(self.lost) if self.lost else "deleted",
              self.record["lease_s"],
          )
          return
        except Exception as error:  # The next renewal may succeed: the lease has 3/4 left.
          logging.warning("renewing the lock on --workdir=%s failed (%s)", self.url, error)


def check_free(path: str) -> None:
  """Raises ``ConfigError`` if a live run holds workdir ``path``'s lock, or if its ``.lock`` is
  not a regular file; writes nothing."""
  if paths.is_url(path):
    found = _read(path)
    if found is not None and found.left_s > 0:
      raise _in_use(path, found.holder, found.left_s)
    return
  fd = _open(path, create=False)
  if fd is None:
    return
  try:
    _locked(fd, path, fcntl.LOCK_SH)
  finally:
    os.close(fd)


def hold(path: str, lease_s: float = LEASE_S) -> Held | Lease:
  """Takes workdir ``path``'s lock (creating ``path``) until the returned :class:`Held` is
  released; ``ConfigError`` if a live run holds it or its ``.lock`` is not a regular file. A lock
  file whose holder is gone is taken over (:attr:`Held.earlier`). A ``gs://`` workdir's is a
  :class:`Lease` of ``lease_s``, taken over once a holder's has lapsed."""
  if paths.is_url(path):
    return _take(path, lease_s)
  os.makedirs(path, exist_ok=True)
  for _ in range(TRIES):
    fd = _open(path, create=True)
    if fd is None:
      continue  # Deleted between the create and the open: its run released it.
    try:
      earlier = _taken(fd, path)
    except BaseException:
      os.close(fd)
      raise
    if earlier is not None:
      return Held(fd, path, earlier or None)
    os.close(fd)  # Its run deleted it after this open: the lock is on a file now gone.
  raise _changed_hands(path)


def _taken(fd: int, path: str) -> dict | None:
  """Locks the open lock file ``fd`` and writes this run's name in it: the holder it named
  before (``{}`` if none), or None if it is no longer at ``path``'s ``.lock`` (deleted)."""
  _locked(fd, path, fcntl.LOCK_EX)
  if not _same(fd, os.path.join(path, LOCK)):
    return None
  earlier = _holder(fd)
  os.ftruncate(fd, 0)
  os.pwrite(fd, (json.dumps(_me()) + "\n").encode(), 0)
  return earlier


def _open(path: str, create: bool) -> int | None:
  """Workdir ``path``'s lock file, opened without following a link or waiting on a pipe, checked
  to be a regular file (else ``ConfigError``); None if absent. ``create``: read-write, created
  if absent; else read-only."""
  lock = os.path.join(path, LOCK)
  flags = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | (os.O_RDWR if create else os.O_RDONLY)
  try:
    fd = _created(lock, flags) if create else None
    if fd is None:
      fd = os.open(lock, flags)
  except FileNotFoundError:
    return None
  except OSError as error:  # ELOOP: a link; ENXIO: a socket; EISDIR: a directory; EACCES.
    raise _refused(path, lock, error) from None
  if not stat.S_ISREG(os.fstat(fd).st_mode):
    os.close(fd)
    raise _refused(path, lock)
  return fd


def _created(lock: str, flags: int) -> int | None:
  """``lock`` created (``O_EXCL``: never through a link), or None if something is there."""
  try:
    return os.open(lock, flags | os.O_CREAT | os.O_EXCL, 0o644)
  except FileExistsError:
    return None


def _same(fd: int, lock: str) -> bool:
  """Whether the file at ``lock`` (not following a link) is the open file ``fd``."""
  try:
    there = os.stat(lock, follow_symlinks=False)
  except FileNotFoundError:
    return False
  here = os.fstat(fd)
  return (there.st_dev, there.st_ino) == (here.st_dev, here.st_ino)


def _refused(path: str, lock: str, error: OSError | None = None) -> ConfigError:
  """The ``ConfigError`` for a lock file that is not a regular file, or that cannot be opened.

  Example:
    >>> import tempfile
    >>> run = tempfile.mkdtemp()
    >>> os.mkdir(os.path.join(run, LOCK))
    >>> print(_refused(run, os.path.join(run, LOCK)))
    --workdir=... is a directory, not a lock file: remove it, or give this run another --workdir
  """
  kind = _kind(lock)
  if kind is None and error is not None:
    return ConfigError(
        f"--workdir={path}: cannot open its lock file {lock} ({error.strerror or error}): "
        "fix its permissions, or give this run another --workdir"
    )
  return ConfigError(
      f"--workdir={path}: {lock} is {kind or 'not a regular file'}, not a lock file: remove it, "
      "or give this run another --workdir"
  )


KINDS = {
    stat.S_IFDIR: "a directory",
    stat.S_IFIFO: "a named pipe (FIFO)",
    stat.S_IFSOCK: "a socket",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
}


def _kind(lock: str) -> str | None:
  """What ``lock`` is, in words, unless it is a regular file or absent (then None).

  Example:
    >>> _kind("/dev/null")
    'a character device'
  """
  try:
    mode = os.lstat(lock).st_mode
  except FileNotFoundError:
    return None
  if stat.S_ISLNK(mode):
    target = os.readlink(lock)
    dangling = "" if os.path.exists(lock) else ", which does not exist"
    return f"a symbolic link (to {target}{dangling})"
  return None if stat.S_ISREG(mode) else KINDS.get(stat.S_IFMT(mode), "not a regular file")


def _locked(fd: int, path: str, mode: int) -> None:
  """Locks ``fd`` in ``mode`` without waiting; ``ConfigError`` naming the holder if taken."""
  try:
    fcntl.flock(fd, mode | fcntl.LOCK_NB)
  except BlockingIOError:
    raise _in_use(path, _holder(fd)) from None


def _in_use(path: str, who: dict, left_s: float | None = None) -> ConfigError:
  lapses = "" if left_s is None else f"; its lease lapses in {left_s:.0f} s if it stopped"
  return ConfigError(
      f"--workdir={path} is in use by another run ({_named(who)}{lapses}): wait for it to end, "
      "or give this run another --workdir"
  )


def _changed_hands(path: str) -> ConfigError:
  return ConfigError(
      f"--workdir={path}: its lock changed hands {TRIES} times while this run tried to take it; "
      "start this run again"
  )


def _named(who: dict) -> str:
  """A holder in words.

  Example:
    >>> _named({"pid": 7, "host": "a", "since": "2026-01-01T00:00:00+00:00"})
    'process 7 on a, since 2026-01-01T00:00:00+00:00'
    >>> _named({"unreadable": "not valid UTF-8"})
    'its lock file names no run: not valid UTF-8'
  """
  if "unreadable" in who:
    return f"its lock file names no run: {who['unreadable']}"
  return f"process {who.get('pid', '?')} on {who.get('host', '?')}, since {who.get('since', '?')}"


def _holder(fd: int) -> dict:
  """The holder the lock file ``fd`` names: ``{}`` if it is empty, ``{"unreadable": why}`` if
  its content is not a JSON object in UTF-8."""
  content = os.pread(fd, 1 << 16, 0)
  if not content.strip():
    return {}
  try:
    holder = json.loads(content.decode())
  except UnicodeDecodeError:
    return {"unreadable": "not valid UTF-8"}
  except json.JSONDecodeError:
    return {"unreadable": "not JSON"}
  return holder if isinstance(holder, dict) else {"unreadable": "not a JSON object"}


def _me() -> dict:
  since = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
  return {"pid": os.getpid(), "host": socket.gethostname(), "since": since}


@dataclasses.dataclass
class _Found:
  """One read of a ``gs://`` lock object."""

  generation: str
  holder: dict
  left_s: float  # Seconds its lease has left (<= 0: lapsed, its holder gone).


def _take(url: str, lease_s: float) -> Lease:
  """Takes ``gs://`` workdir ``url``'s lock: creates the object if absent, or overwrites a
  lapsed one, each write conditional on the generation read (the module docstring: why of runs
  racing, one wins)."""
  me = {**_me(), "token": uuid.uuid4().hex, "lease_s": lease_s}
  earlier = None
  for _ in range(TRIES):
    found = _read(url)
    if found is not None and found.holder.get("token") == me["token"]:
      return Lease(url, me, found.generation, earlier)  # This write landed; its reply was lost.
    if found is not None and found.left_s > 0:
      raise _in_use(url, found.holder, found.left_s)
    earlier = found.holder if found is not None else None
    try:
      generation = _write(url, me, found.generation if found is not None else "0")
    except FileExistsError:  # 412: another run wrote it first; read again.
      continue
    return Lease(url, me, generation, earlier)
  raise _changed_hands(url)


def _object(url: str) -> tuple:
  """gcsfs, and the bucket and name of ``gs://`` workdir ``url``'s lock object."""
  import fsspec  # With gcsfs: the .[gcs] extra, as paths.check has checked.

  fs = fsspec.filesystem("gs")
  bucket, key, _ = fs.split_path(f"{url.rstrip('/')}/{LOCK}")
  return fs, bucket, key


def _read(url: str) -> _Found | None:
  """The lock object of ``gs://`` workdir ``url`` (None if absent): one metadata read, whose
  reply's ``Date`` dates its lease by the server's clock."""
  fs, bucket, key = _object(url)
  try:
    headers, body = fs.call("GET", "b/{}/o/{}", bucket, key)
  except FileNotFoundError:
    return None
  found = json.loads(body)
  holder = dict(found.get("metadata") or {})
  if holder.get("pid", "").isdigit():
    holder["pid"] = int(holder["pid"])
  date = headers.get("Date")
  now = email.utils.parsedate_to_datetime(date) if date else datetime.datetime.now(datetime.UTC)
  age = max(0.0, (now - datetime.datetime.fromisoformat(found["updated"])).total_seconds())
  return _Found(found["generation"], holder, float(holder.get("lease_s", LEASE_S)) - age)


def _write(url: str, record: dict, generation: str) -> str:
  """Writes ``record`` as ``url``'s lock object only if the object is at ``generation`` ("0":
  absent); its new generation, or ``FileExistsError`` (412 Precondition Failed) if not."""
  fs, bucket, key = _object(url)
  meta = json.dumps({"name": key, "metadata": {k: str(v) for k, v in record.items()}})
  body = (
      f"--==0==\nContent-Type: application/json; charset=UTF-8\n\n{meta}\n--==0==\n"
      f"Content-Type: application/json\n\n{json.dumps(record)}\n\n--==0==--"
  )
  written = fs.call(
      "POST",
      f"{fs._location}/upload/storage/v1/b/{urllib.parse.quote(bucket, safe='')}/o",
      uploadType="multipart",
      ifGenerationMatch=generation,
      headers={"Content-Type": 'multipart/related; boundary="==0=="'},
      data=body.encode(),
      json_out=True,
  )
  return written["generation"]


def _delete(url: str, generation: str) -> None:
  """Deletes ``url``'s lock object only if it is at ``generation``."""
  fs, bucket, key = _object(url)
  fs.call("DELETE", "b/{}/o/{}", bucket, key, ifGenerationMatch=generation)
