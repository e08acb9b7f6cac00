"""The run directory: nothing of an earlier run is ever truncated, overwritten or deleted.

``prepare`` runs only after the config passed every check. A fresh run on a workdir that
already holds ``config.json`` / ``metrics.jsonl`` moves them into ``attempt-N/`` inside it and
says so; a resuming run (see the checkpoint module) keeps them. ``MetricsWriter`` adds
each record as one complete JSON line in one write, so a killed run never leaves half a
line, and non-finite numbers are written as ``null``, never as bare ``NaN``. The workdir may
be a ``gs://`` URL: every file goes through ``etils.epath`` (trainers/rundir/paths.py), and
what needs append or rename on a disk is one whole-object write or a copy there.

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

from trainers.errors import ConfigError
from trainers.rundir import paths
from trainers.rundir.events import TENSORBOARD

CONFIG = "config.json"
METRICS = "metrics.jsonl"
RUN_FILES = (CONFIG, METRICS, TENSORBOARD)
ATTEMPT = "attempt-{}"


def check(path: str) -> None:
  """Raises ``ConfigError`` unless ``path`` is, or can become, a writable directory; writes nothing.

  A URL is checked by :func:`paths.check` (its scheme, backend and credentials; no network).

  Example: ``check("/etc/passwd")`` raises: it is a file.
  """
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
  """Keeps the lines of ``path`` (``metrics.jsonl``) up to ``step``; moves the rest to an attempt.

  Lines after ``step`` (from an attempt that died before its next checkpoint) and
  any cut-off line go to ``<workdir>/attempt-N/metrics.jsonl`` (N the first free), and
  the workdir's ``tensorboard/`` with them (its curves then go past ``step``; the caller
  replays the kept records into a fresh one); the file is replaced whole
  (:func:`paths.write_whole`), so it holds each step at most once. Returns the attempt file,
  or None when nothing moved.

  Example: ``keep_metrics_until("runs/lm/metrics.jsonl", 200)``.
  """
  metrics = paths.path(path)
  if not metrics.exists():
    return None
  lines = metrics.read_text().splitlines(keepends=True)
  kept = [_line_step(line) <= step for line in lines]
  if all(kept):
    return None
  attempt = paths.path(new_attempt(os.fspath(metrics.parent)))
  moved_to = attempt / metrics.name
  moved_to.write_text("".join(line for line, keep in zip(lines, kept) if not keep))
  paths.write_whole(metrics, "".join(line for line, keep in zip(lines, kept) if keep))
  events = metrics.parent / TENSORBOARD
  if events.is_dir():
    paths.move(events, attempt / TENSORBOARD)
  return os.fspath(moved_to)


def read_records(path: str) -> list[dict]:
  """The records of ``path`` (a ``metrics.jsonl``), in order; none when it does not exist.

  Example: ``read_records("runs/lm/metrics.jsonl")[0]["step"]`` == 1.
  """
  metrics = paths.path(path)
  if not metrics.exists():
    return []
  return [json.loads(line) for line in metrics.read_text().splitlines()]


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
  last line, which the resuming run moves out (:func:`keep_metrics_until`). A bucket (no append):
  the file is kept here and written whole at each record, one object write each.
  """

  def __init__(self, path: str):
    self.path = os.fspath(paths.path(path) / METRICS)
    self.text = None  # A bucket's file as written so far (read at the first record).

  def write(self, record: dict) -> None:
    """Adds ``record`` as one complete line.

    Example: ``MetricsWriter(workdir).write({"step": 10, "loss": 2.3})``.
    """
    line = json_line(record)
    if paths.is_url(self.path):
      metrics = paths.path(self.path)
      if self.text is None:
        self.text = metrics.read_text() if metrics.exists() else ""
      self.text += line
      metrics.write_text(self.text)
      return
    data = line.encode()
    fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
      written = os.write(fd, data)
    finally:
      os.close(fd)
    if written != len(data):
      raise OSError(f"{self.path}: wrote {written} of {len(data)} bytes (disk full?)")
