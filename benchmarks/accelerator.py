"""The trainer's step on this host's devices, against the plain loop: speed, MFU and memory.

  python -m benchmarks.accelerator --windows 1    # CPU: 8 simulated devices, the tiny model
  python -m benchmarks.accelerator --sizes 125m --seq_len 2048 --batch_size 16   # a GPU or TPU
  bash benchmarks/accelerator.sh                  # the same, installed and time-bound

Each row is one size, optimizer and dtype: the run of ``configs/lm.py:size=S`` with that
optimizer, measured twice on this host's devices.

* **The trainer**: ``trainers.build.build`` and ``build.compile_step`` (as
  ``benchmarks.throughput.setup``), the step run by ``trainers.loop.Loop`` with the "metrics"
  hook every 10 steps (``log_every=10``, writing no file), no eval and no checkpoint, fed by
  ``prefetch.to_device`` of the task's host batches, as ``trainers/train.py`` feeds it.
* **The plain loop**: ``benchmarks.plain_loop.PlainLoop`` of the same config: ``jax.jit`` and
  optax with the same model, batch, dtypes, chain and microbatches; params replicated and the
  batch split over the devices; no plan, no metrics.

Both are timed alike: 10 untimed steps (the first compiles), then ``--windows`` windows of 10
steps, the device waited for at the end of each. A row's step time is the median of its
windows' seconds per step.

Columns, per device: the trainer's steps/s, tokens/s and TFLOP/s; its MFU from the trainer's
count of the step's FLOPs (``metrics.step_cost``: the traced matmuls, 3 x the forward pass plus
the optimizer's update); its MFU from 6N + 12·L·T·d FLOPs per token (N every param, L layers,
T the sequence length, d the model's width: ``utilization.run_formula_flops``); MFU is "n/a"
where the device's bf16 peak is unknown (CPU). Then the compiled step's memory
(``memory_analysis()``: arguments + temporaries + outputs - aliased, GiB), the plain loop's
steps/s, and trainer ÷ plain loop (the plain loop's step time over the trainer's: above 1,
the trainer is faster). A row that fails to compile or run (too big: RESOURCE_EXHAUSTED) says
so in one line, and the next row runs.

Dtypes: "float32", the configs' default; "bfloat16": compute and optimizer state in bfloat16,
params float32; "all-bfloat16": compute, params and state in bfloat16. ``--seq_len``,
``--batch_size`` and ``--grad_accum_steps`` replace the config's; a sequence of 1024 or more
scans and rematerialises the layers (``LONG_SEQ``), as ``configs/lm.py:size=1b`` does.
Prints a markdown table, a row as soon as it is measured.
"""

import os

from trainers import ONE_BLAS_THREAD

os.environ.setdefault(*ONE_BLAS_THREAD)

import argparse
import gc
import itertools
import math
from collections.abc import Callable

import flax.linen as nn
import jax

from benchmarks import plain_loop, throughput
from benchmarks.plain_loop import WINDOW, median_step, per_step, wait
from configs import lm
from trainers import loop, optimizers, start
from trainers.figures import utilization
from trainers.hooks import divergence, metrics
from trainers.input import prefetch
from trainers.models import llama
from trainers.settings import cli

DTYPES = {
    "float32": {},
    "bfloat16": {"compute_dtype": "bfloat16", "state_dtype": "bfloat16"},
    "all-bfloat16": {
        "compute_dtype": "bfloat16",
        "param_dtype": "bfloat16",
        "state_dtype": "bfloat16",
    },
}
LONG_SEQ = 1024  # From this sequence length on, the layers are scanned and rematerialised.
LOG_EVERY = 10  # The trainer's metrics hook reads and logs every 10 steps.
ERROR_CHARS = 200  # A failed row quotes at most this much of the error's first line.
COLUMNS = (
    "steps_per_sec",
    "tokens_per_sec",
    "tflops_per_device",
    "mfu",
    "formula_mfu",
    "compiled_gib",
    "plain_steps_per_sec",
    "vs_plain",
)
HEADER = (
    "| size | optimizer | dtype | steps/s | tokens/s/device | TFLOP/s/device | MFU "
    "| MFU (6N + 12·L·T·d) | compiled GiB/device | plain loop steps/s | trainer ÷ plain loop |"
)


def bench_config(size: str, optimizer: str, dtype: str, windows: int, **shape):
  """``configs/lm.py:size=...`` with ``optimizer`` and ``dtype`` (a key of ``DTYPES``), whose
  run logs every ``LOG_EVERY`` steps and neither evaluates nor ends within ``steps_run(windows)``.

  ``shape``: ``seq_len``, ``batch_size``, ``grad_accum_steps`` to replace (None: the config's).

  Example:
    >>> config = bench_config("125m", "adamw", "all-bfloat16", 3, seq_len=2048, batch_size=None)
    >>> config.seq_len, config.batch_size, config.model.remat, config.param_dtype
    (2048, 32, True, 'bfloat16')
  """
  config = lm.get_config(f"size={size}")
  config.optax_name = optimizer
  config.update(DTYPES[dtype])
  config.update({key: value for key, value in shape.items() if value is not None})
  if config.seq_len >= LONG_SEQ:
    config.model.update(scan_layers=True, remat=True)
  config.total_steps = steps_run(windows) + 1  # Its last step, an eval, is never reached.
  config.eval_every = config.total_steps + 1
  config.log_every = LOG_EVERY
  return config


def steps_run(windows: int) -> int:
  """The steps each loop runs: an untimed window, then ``windows`` timed ones.

  Example:
    >>> steps_run(3)
    40
  """
  return WINDOW * (windows + 1)


def trainer_seconds(config, run, step, cost, windows: int) -> list[float]:
  """Seconds per step of each of ``windows`` timed windows of the trainer's loop
  (``trainers.loop.Loop``), after an untimed one; the device is waited for at the end of each.

  The loop's loss checks, sharding check, metrics reads and log lines as configured (the
  "metrics" hook, writing no file); no checkpoint, eval, trace or preemption hook.
  """
  watch = divergence.LossWatch(config.on_nonfinite, config.lr, write=None)
  begun = start.Start(step=0, source="scratch")
  log = metrics.StepLog(config, run.task, run.learning_rates, begun, None, None, cost)
  local = run.task.batches(run.task.train, global_batch=config.batch_size, seed=0)
  batches = prefetch.to_device(local, step.batch_sharding, run.task.prefetch)
  marks = []
  looped = loop.Loop(step.train, watch, run.plan, config)
  looped.add_hook(name="metrics", every=config.log_every, read=log)
  looped.add_hook(lambda _, state: marks.append(wait(state)), every=WINDOW, name="window")
  try:
    looped.run(throughput.init_state(run), zip(range(1, steps_run(windows) + 1), batches))
  finally:
    batches.close()
  return per_step(marks)


def measure(config, windows: int) -> dict:
  """One row: the ``COLUMNS`` of ``config``'s step (:func:`bench_config` of ``windows``) in
  the trainer and in the plain loop."""
  mesh, run, step, _ = throughput.setup(config, 0)
  with jax.set_mesh(mesh), nn.logical_axis_rules(config.sharding_rules):
    cost = metrics.step_cost(run, step.batch_sharding)
    seconds = median_step(trainer_seconds(config, run, step, cost, windows))
  tokens = config.batch_size * run.task.per_example
  rates = cost.record(1 / seconds, tokens, run.task.unit)
  formula = utilization.run_formula_flops(run, run.config)
  formula_mfu = utilization.rates(formula, 1 / seconds, tokens, cost.num_devices, cost.peak)["mfu"]
  figures = step.figures
  del run, step  # The trainer's compiled step and batches go before the plain loop's arrive.
  gc.collect()
  plain = median_step(plain_loop.PlainLoop(config).window_seconds(windows))
  return {
      "steps_per_sec": 1 / seconds,
      **{c: rates[c] for c in ("tokens_per_sec", "tflops_per_device", "mfu")},
      "formula_mfu": formula_mfu,
      "compiled_gib": None if figures is None else figures.total / 2**30,
      "plain_steps_per_sec": 1 / plain,
      "vs_plain": plain / seconds,
  }


def format_row(size: str, optimizer: str, dtype: str, row: dict) -> str:
  """A markdown table row of ``measure``'s ``row``; "n/a" for an unknown peak or memory.

  Example:
    >>> row = dict(steps_per_sec=2.0, tokens_per_sec=512.0, tflops_per_device=0.002, mfu=None,
    ...     formula_mfu=None, compiled_gib=0.0125, plain_steps_per_sec=2.5, vs_plain=0.8)
    >>> format_row("tiny", "adamw", "float32", row)
    '| tiny | adamw | float32 | 2.00 | 512 | 0.002 | n/a | n/a | 0.0125 | 2.50 | 0.80x |'
    >>> finite(row), finite({**row, "vs_plain": float("nan")})
    (True, False)
  """
  mfu, formula_mfu = (
      "n/a" if row[c] is None else f"{100 * row[c]:.1f}%" for c in ("mfu", "formula_mfu")
  )
  gib = "n/a" if row["compiled_gib"] is None else f"{row['compiled_gib']:.3g}"
  return (
      f"| {size} | {optimizer} | {dtype} | {row['steps_per_sec']:.2f} | "
      f"{row['tokens_per_sec']:.0f} | {row['tflops_per_device']:.3f} | {mfu} | {formula_mfu} | "
      f"{gib} | {row['plain_steps_per_sec']:.2f} | {row['vs_plain']:.2f}x |"
  )


def failed_row(size: str, optimizer: str, dtype: str, error: BaseException) -> str:
  """The one row of a size, optimizer and dtype whose compile or run raised ``error``.

  Example:
    >>> failed_row("1b", "kron", "all-bfloat16", RuntimeError("RESOURCE_EXHAUSTED: 9G\\nmore"))
    '| 1b | kron | all-bfloat16 | does not fit: RuntimeError: RESOURCE_EXHAUSTED: 9G |'
    >>> failed_row("1b", "kron", "float32", ValueError())
    '| 1b | kron | float32 | failed: ValueError |'
  """
  text = str(error).strip()
  exhausted = "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()
  first = f"{type(error).__name__}: {text.splitlines()[0]}" if text else type(error).__name__
  verdict = "does not fit" if exhausted else "failed"
  return f"| {size} | {optimizer} | {dtype} | {verdict}: {first[:ERROR_CHARS]} |"


def finite(row: dict) -> bool:
  """Whether every column of ``row`` is a finite number or, for MFU and memory, None (unknown)."""
  unknown = lambda c: c in ("mfu", "formula_mfu", "compiled_gib") and row[c] is None
  return all(unknown(c) or math.isfinite(row[c]) for c in COLUMNS)


def names(choices) -> Callable[[str], list[str]]:
  """An argparse ``type``: a comma-separated list of ``choices``; anything else is a usage error.

  Example:
    >>> names(["float32", "bfloat16"])("bfloat16,float32")
    ['bfloat16', 'float32']
    >>> names(["float32", "bfloat16"])("fp16")
    Traceback (most recent call last):
    argparse.ArgumentTypeError: 'fp16': expected a comma-separated list of ['bfloat16', 'float32']
  """

  def parse(text: str) -> list[str]:
    chosen = [name for name in text.split(",") if name]
    if not chosen or set(chosen) - set(choices):
      raise argparse.ArgumentTypeError(
          f"{text!r}: expected a comma-separated list of {sorted(choices)}"
      )
    return chosen

  return parse


def row_line(size: str, optimizer: str, dtype: str, args) -> str:
  """The table row of one size, optimizer and dtype: measured, or why it could not be."""
  shape = {k: getattr(args, k) for k in ("seq_len", "batch_size", "grad_accum_steps")}
  try:
    config = bench_config(size, optimizer, dtype, args.windows, **shape)
    return format_row(size, optimizer, dtype, measure(config, args.windows))
  except Exception as error:  # One row says why; the next row runs.
    return failed_row(size, optimizer, dtype, error)


def parser() -> cli.Parser:
  """The command's flags."""
  parse = cli.Parser("python -m benchmarks.accelerator", __doc__)
  parse.add_argument("--sizes", type=names(llama.PRESETS), default="tiny", help="e.g. 125m,1b")
  parse.add_argument(
      "--optimizers", type=names(optimizers.OPTIMIZERS), default="adamw,muon,kron,shampoo,soap"
  )
  parse.add_argument("--dtypes", type=names(DTYPES), default="float32,bfloat16")
  parse.add_argument("--windows", type=cli.at_least(1), default=3, help="timed windows of 10 steps")
  positive = {"type": cli.at_least(1), "default": None, "help": "default: the config's"}
  for flag in ("--seq_len", "--batch_size", "--grad_accum_steps"):
    parse.add_argument(flag, **positive)
  return parse


@cli.command
def main(argv=None):
  args = parser().parse_args(argv)
  jax.config.update("jax_num_cpu_devices", 8)  # The CPU backend only; GPUs and TPUs are as found.
  device = jax.devices()[0]
  print(
      f"jax {jax.__version__}, {jax.device_count()} x {device.device_kind} ({device.platform}); "
      f"median of {args.windows} windows of {WINDOW} steps after {WINDOW} untimed\n"
  )
  print(HEADER)
  print("|---" * (HEADER.count("|") - 1) + "|", flush=True)
  try:
    for size, optimizer, dtype in itertools.product(args.sizes, args.optimizers, args.dtypes):
      print(row_line(size, optimizer, dtype, args), flush=True)
      gc.collect()
  except KeyboardInterrupt:
    print("stopped (interrupted): the rows above are complete", flush=True)
    # Now, without the interpreter's teardown: a compile still running on XLA's threads
    # crashed it on a TPU host (SIGSEGV in PjRtLoadedExecutable::Create).
    os._exit(130)


if __name__ == "__main__":
  main()
