"""What the tests share: the entry points run as users run them, their metrics, tools.

Runs (``python -m <module> ...``) start from the repo root on the CPU backend and
inherit this process's environment (``conftest.py`` gives OpenBLAS one thread and
points every run at the session's jax compilation cache).
"""

import fcntl
import functools
import importlib.util
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from trainers import optimizers

ROOT = pathlib.Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"
# What SLURM sets for each task; jax's cluster detection reads these.
DASHED_FLAG = re.compile(r"--[a-z0-9]+-[a-z0-9]")  # A multi-word flag spelled with dashes.
# Params of every rank a second-order optimizer meets: matrix, vector, scalar, a wide matrix
# and a scanned (L, m, n) stack.
MIXED_PARAMS = {
    "w": jnp.ones((8, 4)),
    "b": jnp.ones(4),
    "s": jnp.ones(()),
    "big": jnp.ones((16, 3000)),
    "stack": jnp.ones((3, 6, 5)),
}
# configs/lm.py's tiny Llama on 32 x 64 tokens: the compiled step whose memory the trainer's
# pre-check and `trainers.plan --compile` measure (one program, compiled once per session).
COMPILED_LM = ("--config.seq_len=64",)
SLURM = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")


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


def tiny_llama(get_config, batch_size: int = 32, **keys):
  """``get_config()`` with a one-layer Llama of width 32, batches of ``batch_size`` x 32 bytes,
  a 2-step warmup, and ``keys`` replaced (in-process runs through trainers/build.py)."""
  config = get_config()
  config.model.update(n_layers=1, d_model=32, n_heads=2, d_ff=64)
  config.seq_len, config.batch_size = 32, batch_size
  config.schedule.warmup_steps = 2
  for key, value in keys.items():
    config[key] = value
  return config


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


def train(workdir, *args: str, config="configs/lm.py", timeout=240, env=None) -> tuple:
  """``python -m trainers.train``: (exit status, stdout + stderr, metrics records)."""
  done = run_module(
      "trainers.train",
      f"--config={config}",
      f"--workdir={workdir}",
      *args,
      timeout=timeout,
      env=env,
  )
  return done.returncode, done.stdout + done.stderr, metrics(workdir)


def metrics(workdir) -> list[dict]:
  """The records of ``workdir/metrics.jsonl``, [] before the first; a line being written is left out."""
  path = pathlib.Path(workdir, "metrics.jsonl")
  lines = path.read_text().split("\n")[:-1] if path.exists() else []
  return [json.loads(line) for line in lines]


# An earlier run's files, which a run that fails its checks must leave byte-identical.
EARLIER = {"config.json": b'{"lr": 0.1}\n', "metrics.jsonl": b'{"step": 1, "loss": 3.0}\n'}


def used_workdir(path: pathlib.Path) -> pathlib.Path:
  """A workdir holding an earlier run's config.json and metrics.jsonl (``EARLIER``)."""
  path.mkdir()
  for name, content in EARLIER.items():
    (path / name).write_bytes(content)
  return path


def assert_untouched(path: pathlib.Path) -> None:
  """``path`` holds exactly ``EARLIER``'s files, byte-identical."""
  assert sorted(p.name for p in path.iterdir()) == sorted(EARLIER)
  for name, content in EARLIER.items():
    assert (path / name).read_bytes() == content


def made_once(tmp_path_factory, name: str, make) -> pathlib.Path:
  """``path``, made by ``make(path)`` once in the session (``path`` does not exist before):
  the first pytest-xdist worker to ask makes it while the others wait for it, then every
  test reads it as it is (one that changes it works on a copy). A failed ``make`` is tried
  again by the next test that asks."""
  root = tmp_path_factory.getbasetemp()
  if os.environ.get("PYTEST_XDIST_WORKER"):  # The workers' base temps share a parent.
    root = root.parent
  shared = root / "made-once"
  shared.mkdir(exist_ok=True)
  path, done = shared / name, shared / f"{name}.done"
  with open(shared / f"{name}.lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)  # Released when the file closes.
    if not done.exists():
      shutil.rmtree(path, ignore_errors=True)
      make(path)
      done.touch()
  return path


def load_tool(name: str):
  """``tools/<name>.py`` imported as a module (``tools/`` holds scripts, not a package)."""
  spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


# Optimizer problems.


def ill_conditioned_regression(seed=0, n=256, d_in=16, d_out=8):
  """Least squares whose Hessian has condition number ~1.1e3, not axis-aligned."""
  rng = np.random.default_rng(seed)
  rotation, _ = np.linalg.qr(rng.standard_normal((d_in, d_in)))
  x = (rng.standard_normal((n, d_in)) * np.logspace(0, 1.5, d_in)) @ rotation.T
  y = x @ rng.standard_normal((d_in, d_out))
  x, y = jnp.asarray(x, jnp.float32), jnp.asarray(y, jnp.float32)
  return lambda p: 0.5 * jnp.mean(jnp.sum((x @ p["w"] - y) ** 2, axis=-1))


def final_loss(loss_fn, name, learning_rate, steps, **kwargs):
  """The loss after ``steps`` of ``optimizers.make_optimizer(name, learning_rate, **kwargs)`` from zeros."""
  schedule = dict(total_steps=steps, decay_type="cosine")
  tx = optimizers.make_optimizer(name, learning_rate, schedule=schedule, **kwargs)

  def step(carry, _):
    params, state = carry
    grads = jax.grad(loss_fn)(params)
    updates, state = tx.update(grads, state, params)
    return (optax.apply_updates(params, updates), state), None

  params = {"w": jnp.zeros((16, 8))}
  run = jax.jit(lambda p: jax.lax.scan(step, (p, tx.init(p)), None, steps)[0][0])
  return float(loss_fn(run(params)))


@functools.cache
def recorded_trajectories() -> tuple:
  """``tests/data/optimizer_reference.npz`` (``tools/make_reference_data.py``): (initial params,
  data, ``section(run)`` -> that run's recorded trajectory)."""
  data = np.load(load_tool("make_reference_data").OUTPUT)
  section = lambda prefix: {
      k.split("/", 1)[1]: data[k] for k in data.files if k.startswith(prefix + "/")
  }
  return section("init"), section("data"), section


def max_deviation(ours: dict, theirs: dict) -> float:
  """Largest absolute difference over all steps of the params and the loss."""
  return max(float(np.max(np.abs(ours[k] - theirs[k]))) for k in theirs)


def help_text(main, capsys) -> str:
  """What an argparse command's ``main(["--help"])`` prints, once it exited with status 0."""
  with pytest.raises(SystemExit) as exited:
    main(["--help"])
  assert exited.value.code == 0
  return capsys.readouterr().out


def assert_snake_case_help(text: str, *flags: str) -> None:
  """``text`` (a command's help) names each of ``flags`` and no flag spelled with dashes."""
  assert all(flag in text for flag in flags) and not DASHED_FLAG.search(text), text
