"""One run of ``python -m trainers.train`` on configs/lm.py, as the quality benchmark starts it.

:func:`flags` spells a run's optimizer, devices, seed and overrides as the trainer's flags;
:func:`result` reads its eval curve from ``metrics.jsonl`` against the training seconds (the
trainer's own ``steps_per_sec``: compile and evals left out); :func:`launch` runs it with its
output in a log file and says when the first and the last step were logged.

Example:
  >>> result([{"step": 1, "steps_per_sec": 0.1}, {"step": 3, "steps_per_sec": 4.0, "eval_loss": 2}])
  {'evals': {3: 2}, 'seconds': {3: 0.5}}
"""

import json
import pathlib
import re
import subprocess
import sys
import time

import ml_collections

from benchmarks import zoo

STEP_LINE = re.compile(r"\bstep (\d+)/\d+ loss=")  # The trainer's line for each logged step.
TUNE_FRACTION = 0.05  # --split tune: the tuning slice, as large as the eval split.
TAIL_LINES = 20  # A failed run's error quotes this many of its last log lines.


def flags(optimizer: str, devices: int, seed: int, extra) -> list[str]:
  """The trainer's flags for one run: ``zoo.train_with``'s optimizer spelling, then overrides.

  Example:
    >>> flags("kron:local:optax.block_size=128", 8, 0, [])[2:]
    ['--config.optax.blocking=local', '--config.optax.block_size=128', '--config.seed=0']
  """
  name, *variant = optimizer.split(":")
  overrides = [f"--config.{v}" for v in variant if "=" in v]
  name = ":".join([name, *(v for v in variant if "=" not in v)])
  config = zoo.train_with(ml_collections.ConfigDict({"optax_name": "", "optax": {}}), name)
  out = [f"--config.optax_name={config.optax_name}", f"--devices_per_process={devices}"]
  out += [f"--config.optax.{k}={v}" for k, v in config.optax.items()]
  return [*out, *overrides, f"--config.seed={seed}", *extra]


def result(records: list[dict]) -> dict:
  """``{"evals": {step: eval loss}, "seconds": {step: training seconds up to it}}``.

  A step's seconds are its interval's steps over the trainer's ``steps_per_sec`` there, which
  leaves the evals out; step 1 (the first transfer and dispatch) is not counted.

  Example:
    >>> result([{"step": 1, "steps_per_sec": 0.1}, {"step": 2, "steps_per_sec": 2.0},
    ...         {"step": 3, "steps_per_sec": 4.0, "eval_loss": 1.5}])
    {'evals': {3: 1.5}, 'seconds': {3: 0.75}}
  """
  seconds, evals, at, last = 0.0, {}, {}, 0
  for r in records:
    if r.get("steps_per_sec") and r["step"] > 1:  # Step 1 compiles.
      seconds += (r["step"] - last) / r["steps_per_sec"]
    last = r["step"]
    if "eval_loss" in r:
      evals[r["step"]], at[r["step"]] = r["eval_loss"], seconds
  return {"evals": evals, "seconds": at}


def records(workdir: pathlib.Path) -> list[dict]:
  """The records of ``workdir/metrics.jsonl``, in order."""
  return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def command(workdir: pathlib.Path, config: str = "configs/lm.py") -> list[str]:
  """The trainer's command line, before :func:`flags`.

  Example:
    >>> command(pathlib.Path("runs/q/adamw"), "configs/lm.py:size=125m")[1:]
    ['-m', 'trainers.train', '--config=configs/lm.py:size=125m', '--workdir=runs/q/adamw']
  """
  return [sys.executable, "-m", "trainers.train", f"--config={config}", f"--workdir={workdir}"]


def launch(cmd: list[str], log: pathlib.Path) -> dict:
  """Runs ``cmd`` with its output in ``log``; seconds from its launch to its first logged step
  (``"first"``: start-up, compile, init and step 1), to its last (``"last"``) and to its exit
  (``"wall"``). A run that fails raises, quoting the log's last lines."""
  marks, begun = [], time.perf_counter()
  with log.open("w") as out, subprocess.Popen(
      cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
  ) as child:
    for line in child.stdout:
      out.write(line)
      if STEP_LINE.search(line):
        marks.append(time.perf_counter() - begun)
  if child.returncode or not marks:
    tail = "".join(log.read_text().splitlines(keepends=True)[-TAIL_LINES:])
    raise RuntimeError(f"{' '.join(cmd[1:3])} failed (exit {child.returncode}), log {log}:\n{tail}")
  return {"first": marks[0], "last": marks[-1], "wall": time.perf_counter() - begun}
