"""The run directory: nothing of an earlier run is ever truncated, overwritten or deleted.

``prepare`` runs only after the config passed every check. A fresh run on a workdir that
already holds ``config.json`` / ``metrics.jsonl`` moves them into ``attempt-N/`` inside it and
says so; a resuming run (see the checkpoint module) keeps them. ``MetricsWriter`` adds
each record as one complete JSON line in one write, so a killed run never leaves half a
line, and non-finite numbers are written as ``null``, never as bare ``NaN``. The workdir may
be a ``gs://`` URL: every file goes through ``etils.epath`` (trainers/rundir/paths.py), and
what needs rename on a disk is one whole-object write or a copy there. A bucket has no append
either: there the records go into ``metrics/00000001.jsonl``, ``00000002.jsonl``, ... (one new
object per write of what is queued, from a background thread: trainers/rundir/parts.py), and
:func:`read_records` reads ``metrics.jsonl`` and then those parts as one file.

Example:
  >>> import os, tempfile
  >>> run = tempfile.mkdtemp()
  >>> prepare(run, resuming=False) is None  # an empty workdir: nothing to move
  True
  >>> write_config(run, '{"lr": 0.001}')
  >>> metrics = MetricsWriter(run)
  >>> metrics.write({"step": 1, "loss": float("nan")})
  >>> open(os.path.join(run, METRICS)).read()
  '{"step": 1, "loss": null}\\n'
  >>> note = prepare(run, resuming=False)  # a fresh run on a used workdir
  >>> note.endswith("into " + os.path.join(run, "attempt-1") + " (nothing deleted); starting fresh")
  True
  >>> sorted(os.listdir(os.path.join(run, "attempt-1")))
  ['config.json', 'metrics.jsonl']
"""

import json
import math
import os
from collections.abc import Callable

from trainers.errors import ConfigError
from trainers.rundir import parts, paths
from trainers.rundir.events import TENSORBOARD

CONFIG = "config.json"
METRICS = "metrics.jsonl"
METRIC_PARTS = "metrics"  # A bucket's records: metrics/00000001.jsonl, ... (after metrics.jsonl).
PART = "{:08d}.jsonl"
RUN_FILES = (CONFIG, METRICS, METRIC_PARTS, TENSORBOARD)
ATTEMPT = "attempt-{}"


def check(path: str) -> None:
  """Raises ``ConfigError`` unless ``path`` is, or can become, a writable directory; writes nothing.

  A URL is checked by :func:`paths.check` (its scheme, backend and credentials; no network).

  Example: ``check("/etc/passwd")`` raises: it is a file; so do ``check("")`` and
  ``check("gs:/bucket/run")`` (a URL missing a slash, which would become a local ``gs:`` folder).
  """
  if not path:
    raise ConfigError("--workdir is empty; name a directory (e.g. runs/lm) or a gs:// URL")
  mangled = paths.mangled_url(path)
  if mangled:
    raise ConfigError(f"--workdir={path} looks like a URL missing a slash; write {mangled}")
  if paths.is_url(path):
    paths.check(path)
    return
  existing = path
  while existing and not os.path.exists(existing):
    existing = os.path.dirname(existing.rstrip("/"))
  existing = existing or "."
  if not os.path.isdir(existing):
    raise ConfigError(f"--workdir={path}: {existing} is a file, not a directory; name a directory")
  if not os.access(existing, os.W_OK | os.X_OK):
    raise ConfigError(f"--workdir={path}: {existing} is not writable; name a directory you own")


def prepare(path: str, *, resuming: bool) -> str | None:
  """Creates ``path``; unless ``resuming``, moves an earlier run's files aside; a note or None.

  Example: ``prepare(workdir, resuming=False)`` on a used workdir returns
  "workdir ... held an earlier run: moved config.json, metrics.jsonl into .../attempt-1".
  """
  run = paths.path(path)
  run.mkdir(parents=True, exist_ok=True)
  earlier = [name for name in RUN_FILES if (run / name).exists()]
  if resuming or not earlier:
    return None
  attempt = move_to_attempt(path, earlier)
  return (
      f"workdir {path} held an earlier run: moved {', '.join(earlier)} into {attempt} "
      "(nothing deleted); starting fresh"
  )


def move_to_attempt(path: str, names) -> str:
  """Moves files ``names`` of ``path`` into its first unused ``attempt-N/``; returns that directory.

  Example: ``move_to_attempt(workdir, ["metrics.jsonl"])`` == f"{workdir}/attempt-1".
  """
  attempt = new_attempt(path)
  for name in names:
    paths.move(paths.path(path) / name, paths.path(attempt) / name)
  return attempt


def new_attempt(path: str) -> str:
  """Creates and returns the first unused ``attempt-N/`` directory of workdir ``path``.

  In a bucket a directory exists once an object is in it: the caller moves files in at once.

  Example: ``new_attempt(workdir)`` == f"{workdir}/attempt-1" on a workdir without attempts.
  """
  n = 1
  while (paths.path(path) / ATTEMPT.format(n)).exists():
    n += 1
  attempt = paths.path(path) / ATTEMPT.format(n)
  attempt.mkdir()
  return os.fspath(attempt)


def keep_metrics_until(path: str, step: int) -> str | None:
  """Keeps the lines of ``path`` (``metrics.jsonl``, and its parts) up to ``step``; moves the
  rest to an attempt.

  Lines after ``step`` (from an attempt that died before its next checkpoint) and
  any cut-off line go to ``<workdir>/attempt-N/metrics.jsonl`` (N the first free), and
  the workdir's ``tensorboard/`` with them (its curves then go past ``step``; the caller
  replays the kept records into a fresh one); each file that loses lines is replaced whole
  (:func:`paths.write_whole`; a bucket's part left with none is deleted), so the records hold
  each step at most once. Returns the attempt file, or None when nothing moved.

  Example: ``keep_metrics_until("runs/lm/metrics.jsonl", 200)``.
  """
  lines = {piece: piece.read_text().splitlines(keepends=True) for piece in record_files(path)}
  dropped = [line for held in lines.values() for line in held if _line_step(line) > step]
  if not dropped:
    return None
  metrics = paths.path(path)
  attempt = paths.path(new_attempt(os.fspath(metrics.parent)))
  moved_to = attempt / metrics.name
  moved_to.write_text("".join(dropped))
  for piece, held in lines.items():
    kept = [line for line in held if _line_step(line) <= step]
    if len(kept) == len(held):
      continue
    if kept or piece == metrics:
      paths.write_whole(piece, "".join(kept))
    else:
      piece.unlink()
  events = metrics.parent / TENSORBOARD
  if events.is_dir():
    paths.move(events, attempt / TENSORBOARD)
  return os.fspath(moved_to)


def record_files(path: str) -> list:
  """The files holding the records of ``path`` (a ``metrics.jsonl``), in order: itself, then a
  bucket's parts (``metrics/00000001.jsonl``, ...), those that exist.

  Example: ``record_files("gs://b/run/metrics.jsonl")`` -> [".../metrics/00000001.jsonl", ...].
  """
  metrics = paths.path(path)
  whole = [metrics] if metrics.exists() else []
  return whole + parts.part_names(metrics.parent / METRIC_PARTS, PART)


def read_records(path: str) -> list[dict]:
  """The records of ``path`` (a ``metrics.jsonl``, and its parts), in order; none when there
  are none.

  Example: ``read_records("runs/lm/metrics.jsonl")[0]["step"]`` == 1.
  """
  texts = [piece.read_text() for piece in record_files(path)]
  return [json.loads(line) for text in texts for line in text.splitlines()]


def _line_step(line: str) -> float:
  """A metrics line's step; infinity for a cut-off or unreadable line."""
  try:
    return json.loads(line)["step"] if line.endswith("\n") else math.inf
  except (ValueError, KeyError, TypeError):
    return math.inf


def write_config(path: str, text: str) -> None:
  """Writes ``config.json`` whole (:func:`paths.write_whole`).

  Example: ``write_config(workdir, config.to_json_best_effort(indent=2))``.
  """
  paths.write_whole(paths.path(path) / CONFIG, text)


def json_line(record: dict) -> str:
  """``record`` as one line of strict JSON; NaN and infinities become ``null``.

  Example: ``json_line({"loss": float("inf")})`` == '{"loss": null}\\n'.
  """
  finite = {
      k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()
  }
  return json.dumps(finite, allow_nan=False) + "\n"


class MetricsWriter:
  """Adds records to ``metrics.jsonl``, each as one complete line.

  Local: each line appended in a single ``os.write`` of the whole line; only a process killed
  inside that write (Linux ends a write at a page boundary on SIGKILL) can leave a cut-off
  last line, which the resuming run moves out (:func:`keep_metrics_until`). A bucket (no
  append): the lines are queued, and a thread writes what is queued as the next part,
  ``metrics/NNNNNNNN.jsonl`` (:class:`parts.Parts`): :meth:`write` does not wait on the
  bucket, and each line is sent once. :meth:`until_written` gives a wait for the lines
  written so far: the trainer's checkpoint save calls it on its own thread before it saves,
  so a checkpoint is committed only after every record up to its step is in the bucket, and
  the loop does not wait (``trainers/loop.py``, :class:`Pending`); :meth:`close` waits for all.
  """

  def __init__(self, path: str):
    self.path = os.fspath(paths.path(path) / METRICS)
    bucket = paths.is_url(self.path)
    self.parts = parts.Parts(paths.path(path) / METRIC_PARTS, PART) if bucket else None

  def write(self, record: dict) -> None:
    """Adds ``record`` as one complete line.

    Example: ``MetricsWriter(workdir).write({"step": 10, "loss": 2.3})``.
    """
    data = json_line(record).encode()
    if self.parts is not None:
      self.parts.put(data)
      return
    fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
      written = os.write(fd, data)
    finally:
      os.close(fd)
    if written != len(data):
      raise OSError(f"{self.path}: wrote {written} of {len(data)} bytes (disk full?)")

  def until_written(self) -> Callable[[], None]:
    """A wait (callable from any thread) until every record written so far is in the bucket,
    not those written later; local: nothing to wait for."""
    return (lambda: None) if self.parts is None else self.parts.until_written()

  def close(self) -> None:
    """Flushes; ends a bucket's writer thread."""
    if self.parts is not None:
      self.parts.close()
