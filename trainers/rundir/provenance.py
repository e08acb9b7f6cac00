"""What produced a workdir: the config of every start, package versions, the git revision.

Each start writes ``starts/<i>/config.json`` and ``starts/<i>/start.json`` (the
step it began at, where that came from, argv, processes, devices, versions, git
revision); ``config.json`` at the top is the config of the start that began at
step 0, not rewritten by a resume, so a later change (of optimizer, say) does not
hide what trained the first steps.

Example:
  >>> import json, os, tempfile
  >>> import ml_collections
  >>> run = tempfile.mkdtemp()
  >>> config = ml_collections.ConfigDict({"lr": 1e-3})
  >>> first = record_start(run, config, start_step=0, source="init")
  >>> resumed = record_start(run, config, start_step=200, source=f"{run}/checkpoints/200")
  >>> os.path.relpath(first, run), os.path.relpath(resumed, run)
  ('starts/0', 'starts/1')
  >>> json.load(open(os.path.join(resumed, "start.json")))["start_step"]
  200
"""

import importlib.metadata
import json
import os
import pathlib
import platform
import subprocess
import sys
import time

import jax

from trainers.rundir import paths
from trainers.rundir import workdir as workdir_lib

PACKAGES = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy", "ml_collections")
REPO = pathlib.Path(__file__).resolve().parents[1]


def versions() -> dict[str, str | None]:
  """Installed versions of Python, bv_sharding and the packages training depends on.

  Example: ``versions()["jax"]`` == "0.10.2".
  """
  found = {"python": platform.python_version()}
  for name in ("bv_sharding", *PACKAGES):
    try:
      found[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      found[name] = None
  return found


def git_revision(repo: pathlib.Path = REPO) -> str | None:
  """``HEAD``'s commit of the project's checkout (``+dirty`` if files changed); None if unknown.

  Example: ``git_revision()`` == "5f8a1ee...+dirty".
  """
  try:
    head = subprocess.run(
        ["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10
    )
    dirty = subprocess.run(
        ["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
        capture_output=True,
        text=True,
        timeout=10,
    )
  except (OSError, subprocess.TimeoutExpired):
    return None
  if head.returncode:
    return None
  return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def record_start(workdir: str, config, start_step: int, source: str) -> str:
  """Writes this start's config and provenance to ``workdir/starts/<i>``; returns that directory."""
  config_json = config.to_json_best_effort(indent=2)
  run = paths.path(workdir)
  if start_step == 0 or not (run / workdir_lib.CONFIG).exists():
    workdir_lib.write_config(workdir, config_json)
  i = 0
  while (run / "starts" / str(i)).exists():  # In a bucket: once its files are written.
    i += 1
  here = run / "starts" / str(i)
  here.mkdir(parents=True)
  _write(here / "config.json", config_json)
  start = {
      "start_step": start_step,
      "from": source,
      "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
      "argv": sys.argv,
      "processes": jax.process_count(),
      "devices": jax.device_count(),
      "platform": jax.default_backend(),
      "versions": versions(),
      "git_revision": git_revision(),
  }
  _write(here / "start.json", json.dumps(start, indent=2))
  return os.fspath(here)


def write_text(target: str, text: str) -> None:
  """``text`` and a newline into ``target`` (a local path or a ``gs://`` URL).

  Example: ``write_text(os.path.join(record_start(...), "plan.txt"), plan.report())``.
  """
  _write(paths.path(target), text)


def _write(target, text: str) -> None:
  target.write_text(text + "\n")
