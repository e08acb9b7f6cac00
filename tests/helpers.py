"""The real entry points run in subprocesses, as users run them: ``python -m <module> ...``.

Runs start from the repo root on the CPU backend and inherit this process's
environment (``conftest.py`` gives OpenBLAS one thread; see ``trainers/__init__.py``).
"""

import importlib.util
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"


def quick_lm(total_steps: int, log_every: int, eval_every: int, eval_batches: int) -> tuple:
  """``--config.k=v`` overrides for a short ``configs/lm.py`` run: batches of 16 x 64 bytes."""
  return (
      f"--config.total_steps={total_steps}",
      "--config.batch_size=16",
      "--config.seq_len=64",
      f"--config.log_every={log_every}",
      f"--config.eval_every={eval_every}",
      f"--config.eval_batches={eval_batches}",
      # big_vision's schedules need the warmup to end before the run does.
      f"--config.schedule.warmup_steps={min(10, total_steps // 2)}",
  )


def environment(**extra: str) -> dict:
  """This process's environment on the CPU backend, ``extra`` variables added."""
  return {**os.environ, "JAX_PLATFORMS": "cpu", **extra}


def run_module(
    module: str, *args: str, timeout: float, env: dict | None = None
) -> subprocess.CompletedProcess:
  """``python -m module *args``; output captured as text, the exit status not checked."""
  return subprocess.run(
      [sys.executable, "-m", module, *args],
      cwd=ROOT,
      env=environment(**(env or {})),
      capture_output=True,
      text=True,
      timeout=timeout,
  )


def load_tool(name: str):
  """``tools/<name>.py`` imported as a module (``tools/`` holds scripts, not a package)."""
  spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module
