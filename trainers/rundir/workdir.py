"""The run directory: nothing of an earlier run is ever truncated, overwritten or deleted.

``prepare`` runs only after the config passed every check. A fresh run on a workdir that
already holds ``config.json`` / ``metrics.jsonl`` moves them into ``attempt-N/`` inside it and
says so; a resuming run (see the checkpoint module) keeps them. ``MetricsWriter`` appends
each record as one complete JSON line in one write, so a killed run never leaves half a
line, and non-finite numbers are written as ``null``, never as bare ``NaN``.

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
from trainers.rundir.events import TENSORBOARD

CONFIG = "config.json"
METRICS = "metrics.jsonl"
RUN_FILES = (CONFIG, METRICS, TENSORBOARD)
ATTEMPT = "attempt-{}"


def check(path: str) -> None:
  """Raises ``ConfigError`` unless ``path`` is, or can become, a writable directory; writes nothing.

  Example: ``check("/etc/passwd")`` raises: it is a file.
  """
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
  os.makedirs(path, exist_ok=True)
  earlier = [name for name in RUN_FILES if os.path.exists(os.path.join(path, name))]
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
    os.replace(os.path.join(path, name), os.path.join(attempt, name))
  return attempt


def new_attempt(path: str) -> str:
  """Creates and returns the first unused ``attempt-N/`` directory of workdir ``path``.

  Example: ``new_attempt(workdir)`` == f"{workdir}/attempt-1" on a workdir without attempts.
  """
  n = 1
  while os.path.exists(os.path.join(path, ATTEMPT.format(n))):
    n += 1
  attempt = os.path.join(path, ATTEMPT.format(n))
  os.makedirs(attempt)
  return attempt


def keep_metrics_until(path: str, step: int) -> str | None:
  """Keeps the lines of ``path`` (``metrics.jsonl``) up to ``step``; moves the rest to an attempt.

  Lines after ``step`` (from an attempt that died before its next checkpoint) and
  any cut-off line go to ``<workdir>/attempt-N/metrics.jsonl`` (N the first free), and
  the workdir's ``tensorboard/`` with them (its curves then go past ``step``; the caller
  replays the kept records into a fresh one); the file is replaced atomically, so it
  holds each step at most once. Returns the attempt file, or None when nothing moved.

  Example: ``keep_metrics_until("runs/lm/metrics.jsonl", 200)``.
  """
  if not os.path.exists(path):
    return None
  with open(path) as f:
    lines = f.readlines()
  kept = [_line_step(line) <= step for line in lines]
  if all(kept):
    return None
  attempt = new_attempt(os.path.dirname(path))
  moved_to = os.path.join(attempt, os.path.basename(path))
  with open(moved_to, "w") as f:
    f.writelines(line for line, keep in zip(lines, kept) if not keep)
  with open(path + ".tmp", "w") as f:
    f.writelines(line for line, keep in zip(lines, kept) if keep)
  os.replace(path + ".tmp", path)
  events = os.path.join(os.path.dirname(path), TENSORBOARD)
  if os.path.isdir(events):
    os.replace(events, os.path.join(attempt, TENSORBOARD))
  return moved_to


def read_records(path: str) -> list[dict]:
  """The records of ``path`` (a ``metrics.jsonl``), in order; none when it does not exist.

  Example: ``read_records("runs/lm/metrics.jsonl")[0]["step"]`` == 1.
  """
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f]


def _line_step(line: str) -> float:
  """A metrics line's step; infinity for a cut-off or unreadable line."""
  try:
    return json.loads(line)["step"] if line.endswith("\n") else math.inf
  except (ValueError, KeyError, TypeError):
    return math.inf


def write_config(path: str, text: str) -> None:
  """Writes ``config.json`` whole: to a temporary file first, then renamed into place.

  Example: ``write_config(workdir, config.to_json_best_effort(indent=2))``.
  """
  tmp = os.path.join(path, f".{CONFIG}.tmp")
  with open(tmp, "w") as f:
    f.write(text)
  os.replace(tmp, os.path.join(path, CONFIG))


def json_line(record: dict) -> str:
  """``record`` as one line of strict JSON; NaN and infinities become ``null``.

  Example: ``json_line({"loss": float("inf")})`` == '{"loss": null}\\n'.
  """
  finite = {
      k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()
  }
  return json.dumps(finite, allow_nan=False) + "\n"


class MetricsWriter:
  """Appends records to ``metrics.jsonl``, each line in a single ``os.write`` of the whole line."""

  def __init__(self, path: str):
    self.path = os.path.join(path, METRICS)

  def write(self, record: dict) -> None:
    """Appends ``record`` as one complete line.

    Example: ``MetricsWriter(workdir).write({"step": 10, "loss": 2.3})``.
    """
    line = json_line(record).encode()
    fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
      written = os.write(fd, line)
    finally:
      os.close(fd)
    if written != len(line):
      raise OSError(f"{self.path}: wrote {written} of {len(line)} bytes (disk full?)")
