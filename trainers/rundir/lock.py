"""One run per workdir: the run holds a lock on it for as long as it lives.

A local workdir's lock is an advisory ``flock`` on ``<workdir>/.lock``, a file that names its
holder (host, process id, start time). The kernel releases the lock when the holder exits, by
any means (``kill -9`` included), so a lock left by a killed run is free and the next run
takes it over, saying whose it was. :func:`check_free` only looks (it writes nothing, so a run
whose config fails its checks leaves the workdir as it was); :func:`hold` takes the lock, once
every check has passed. Either raises ``ConfigError`` naming the holder while another run
lives. A ``gs://`` workdir is not locked (a bucket has no such lock).

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

import dataclasses
import datetime
import fcntl
import json
import os
import socket
from typing import IO

from trainers.errors import ConfigError
from trainers.rundir import paths

LOCK = ".lock"


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


def check_free(path: str) -> None:
  """Raises ``ConfigError`` if a live run holds workdir ``path``'s lock; writes nothing."""
  lock = os.path.join(path, LOCK)
  if paths.is_url(path) or not os.path.exists(lock):
    return
  with open(lock) as file:
    _locked(file, path, fcntl.LOCK_SH)


def hold(path: str) -> Held:
  """Takes workdir ``path``'s lock (creating ``path``) for as long as the returned :class:`Held`
  is kept (a dropped one closes its file, which frees the lock); ``ConfigError`` if a live run
  holds it. A lock file whose holder is gone is taken over (:attr:`Held.earlier`)."""
  if paths.is_url(path):
    return Held(None)
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
    who = _holder(file)
    raise ConfigError(
        f"--workdir={path} is in use by another run (process {who.get('pid', '?')} on "
        f"{who.get('host', '?')}, since {who.get('since', '?')}): wait for it to end, or give "
        "this run another --workdir"
    ) from None


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
