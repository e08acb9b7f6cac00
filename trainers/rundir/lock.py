"""One run per workdir: the run holds a lock on it for as long as it lives.

A local workdir's lock is an advisory ``flock`` on ``<workdir>/.lock``, a file that names its
holder (host, process id, start time). The kernel releases the lock when the holder exits, by
any means (``kill -9`` included), so a lock left by a killed run is free and the next run
takes it over, saying whose it was. :func:`check_free` only looks (it writes nothing, so a run
whose config fails its checks leaves the workdir as it was); :func:`hold` takes the lock, once
every check has passed. Either raises ``ConfigError`` naming the holder while another run
lives.

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
import threading
import urllib.parse
import uuid
from typing import IO

from absl import logging

from trainers.errors import ConfigError
from trainers.rundir import paths

LOCK = ".lock"
LEASE_S = 60.0  # A gs:// lock's lease, renewed every quarter of it: a killed run's lapses so.
TRIES = 5  # Reads and conditional writes before hold gives up on a gs:// lock changing hands.


@dataclasses.dataclass
class Held:
  """A held workdir lock (its open file); :meth:`release` frees it, as the process's exit does.

  ``earlier``: the holder named in the lock file when it was taken over, else None.
  """

  file: IO | None
  earlier: dict | None = None

  def release(self) -> None:
    if self.file is not None:
      self.file.close()
      self.file = None

  def check(self) -> None:
    """Nothing: a local lock lives as long as its holder (see :meth:`Lease.check`)."""


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
  """Raises ``ConfigError`` if a live run holds workdir ``path``'s lock; writes nothing."""
  if paths.is_url(path):
    found = _read(path)
    if found is not None and found.left_s > 0:
      raise _in_use(path, found.holder, found.left_s)
    return
  lock = os.path.join(path, LOCK)
  if not os.path.exists(lock):
    return
  with open(lock) as file:
    _locked(file, path, fcntl.LOCK_SH)


def hold(path: str, lease_s: float = LEASE_S) -> Held | Lease:
  """Takes workdir ``path``'s lock (creating ``path``) for as long as the returned :class:`Held`
  is kept (a dropped one closes its file, which frees the lock); ``ConfigError`` if a live run
  holds it. A lock file whose holder is gone is taken over (:attr:`Held.earlier`). A ``gs://``
  workdir's is a :class:`Lease` of ``lease_s``, taken over once a holder's has lapsed."""
  if paths.is_url(path):
    return _take(path, lease_s)
  os.makedirs(path, exist_ok=True)
  file = open(os.path.join(path, LOCK), "a+")  # Open until released: the lock lives with it.
  try:
    _locked(file, path, fcntl.LOCK_EX)
  except ConfigError:
    file.close()
    raise
  earlier = _holder(file)
  file.seek(0)
  file.truncate()
  file.write(json.dumps(_me()) + "\n")
  file.flush()
  return Held(file, earlier or None)


def _locked(file: IO, path: str, mode: int) -> None:
  """Locks ``file`` in ``mode`` without waiting; ``ConfigError`` naming the holder if taken."""
  try:
    fcntl.flock(file, mode | fcntl.LOCK_NB)
  except BlockingIOError:
    raise _in_use(path, _holder(file)) from None


def _in_use(path: str, who: dict, left_s: float | None = None) -> ConfigError:
  lapses = "" if left_s is None else f"; its lease lapses in {left_s:.0f} s if it stopped"
  return ConfigError(
      f"--workdir={path} is in use by another run ({_named(who)}{lapses}): wait for it to end, "
      "or give this run another --workdir"
  )


def _named(who: dict) -> str:
  return f"process {who.get('pid', '?')} on {who.get('host', '?')}, since {who.get('since', '?')}"


def _holder(file: IO) -> dict:
  """The holder the lock file names (``{}`` if it names none)."""
  file.seek(0)
  try:
    return json.loads(file.read() or "{}")
  except json.JSONDecodeError:
    return {}


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
  raise ConfigError(
      f"--workdir={url}: its lock changed hands {TRIES} times while this run tried to take it; "
      "start this run again"
  )


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
