"""The trainer's step on this host's devices: speed, MFU, compiled memory and host-sync overhead.

  python -m benchmarks.accelerator        # CPU: 8 simulated devices, the tiny model
  python -m benchmarks.accelerator --sizes 1b --steps 10     # one GPU or TPU host
  benchmarks/accelerator.sh               # the same on an accelerator, installed and time-bound

For each size, optimizer and dtype, the trainer's run of ``configs/lm.py:size=S``
(``trainers/build.py``: the config's optimizer, its plan, the train step the trainer
compiles, ``build.compile_step``), and that one compiled step runs twice, after one untimed
warm-up step (on the ``benchmarks.throughput`` batches):

* in the **bare loop**: ``--steps`` steps dispatched back to back, one wait at the end;
* in the **training loop**, ``trainers.loop.Loop`` as the trainer runs it from step 1 (its
  sharding check after the first step, its metrics reads, loss checks and log lines at the config's
  log steps: 1 and 20 with ``log_every=20``), saving no checkpoint and evaluating nothing;
  it ends when the last step's state is ready.

The two take turns ``--repeats`` times; each keeps its fastest turn.

Dtype "float32" is the configs' default; "bfloat16" sets ``config.compute_dtype`` and
``config.state_dtype`` to bfloat16 (params stay float32: mixed precision). Columns, per device:
steps/s and tokens/s of the training loop; TFLOP/s and MFU from the step's model FLOPs
(``trainers/figures/utilization.py``: the traced matmuls, every scanned layer counted, 3 x the forward
pass plus the optimizer's update, rematerialised forward passes not counted; MFU "n/a" where
the device's bf16 peak is unknown, e.g. on CPU); the compiled step's memory
(``memory_analysis()``: arguments + temporaries + outputs - aliased, in GiB);
and the sync overhead, the training loop's seconds per step over the bare loop's. Prints a
markdown table, a row as soon as it is measured.
"""

import os

from trainers import ONE_BLAS_THREAD

os.environ.setdefault(*ONE_BLAS_THREAD)

import argparse
import itertools
import math
import time
from collections.abc import Callable

import flax.linen as nn
import jax

from benchmarks import throughput
from benchmarks.timing import seconds_per_step
from trainers import loop, optimizers, start
from trainers.hooks import divergence, metrics
from trainers.models import llama
from trainers.settings import cli

DTYPES = {
    "float32": {},
    "bfloat16": {"compute_dtype": "bfloat16", "state_dtype": "bfloat16"},
}
WARMUP = 1  # The step is compiled already: one untimed step settles the caches.
COLUMNS = (
    "steps_per_sec",
    "tokens_per_sec",
    "tflops_per_device",
    "mfu",
    "compiled_gib",
    "sync_overhead",
)
HEADER = (
    "| size | optimizer | dtype | steps/s | tokens/s/device | TFLOP/s/device | MFU "
    "| compiled GiB/device | sync overhead |"
)


def bench_config(size: str, optimizer: str, dtype: str, num_steps: int):
  """``configs/lm.py:size=...`` with ``optimizer`` and ``dtype`` (a key of ``DTYPES``), whose
  training loop neither evaluates nor stops within ``num_steps`` steps."""
  config = throughput.lm_config(size, optimizer)
  config.update(DTYPES[dtype])
  config.total_steps = max(config.total_steps, num_steps + 1)
  config.eval_every = config.total_steps + 1
  return config


def loop_seconds(config, run, compiled, cost, state, batches) -> tuple[dict, float]:
  """``(state, seconds per step)`` of the trainer's loop (``trainers.loop.Loop``) over
  ``batches`` from step 1, until the last step's state is ready.

  Its loss checks, metrics reads and log lines as configured (the trainer's "metrics" hook,
  writing no file); no other hook: no checkpoint, eval, trace or preemption.
  """
  watch = divergence.LossWatch(config.on_nonfinite, config.lr, write=None)
  begun = start.Start(step=0, source="scratch")
  log = metrics.StepLog(config, run.task, run.learning_rates, begun, None, None, cost)
  began = time.perf_counter()
  looped = loop.Loop(compiled, watch, run.plan, config)
  looped.add_hook(name="metrics", every=config.log_every, read=log)
  state = jax.block_until_ready(looped.run(state, zip(itertools.count(1), batches)))
  return state, (time.perf_counter() - began) / len(batches)


def measure(config, num_steps: int, repeats: int = 1) -> dict:
  """One row: the ``COLUMNS`` of ``config``'s train step over ``num_steps`` timed steps.

  The bare loop and the training loop take turns ``repeats`` times on the same batches; each
  keeps its fastest turn (a host shared with other work slows some turns, never speeds one).
  """
  mesh, run, step, batches = throughput.setup(config, WARMUP + num_steps)
  compiled, figures = step.train, step.figures
  bare, in_loop = math.inf, math.inf
  with jax.set_mesh(mesh), nn.logical_axis_rules(config.sharding_rules):
    cost = metrics.step_cost(run, step.batch_sharding)
    state = throughput.init_state(run)
    for batch in batches[:WARMUP]:
      state, _ = compiled(state, batch)
    for _ in range(repeats):
      state, seconds = seconds_per_step(compiled, state, batches[WARMUP:], num_steps, warmup=0)
      bare = min(bare, seconds)
      state, seconds = loop_seconds(config, run, compiled, cost, state, batches[WARMUP:])
      in_loop = min(in_loop, seconds)
  rates = cost.record(1 / in_loop, config.batch_size * run.task.per_example, run.task.unit)
  return {
      "steps_per_sec": 1 / in_loop,
      **{c: rates[c] for c in ("tokens_per_sec", "tflops_per_device", "mfu")},
      "compiled_gib": None if figures is None else figures.total / 2**30,
      "sync_overhead": in_loop / bare,
  }


def format_row(size: str, optimizer: str, dtype: str, row: dict) -> str:
  """A markdown table row of ``measure``'s ``row``; "n/a" for an unknown peak or memory.

  Example:
    >>> row = dict(steps_per_sec=2.0, tokens_per_sec=512.0, tflops_per_device=0.002, mfu=None,
    ...     compiled_gib=0.0125, sync_overhead=1.04)
    >>> format_row("tiny", "adamw", "float32", row)
    '| tiny | adamw | float32 | 2.00 | 512 | 0.002 | n/a | 0.0125 | 1.04x |'
    >>> finite(row), finite({**row, "sync_overhead": float("nan")})
    (True, False)
  """
  mfu = "n/a" if row["mfu"] is None else f"{100 * row['mfu']:.1f}%"
  gib = "n/a" if row["compiled_gib"] is None else f"{row['compiled_gib']:.3g}"
  return (
      f"| {size} | {optimizer} | {dtype} | {row['steps_per_sec']:.2f} | "
      f"{row['tokens_per_sec']:.0f} | {row['tflops_per_device']:.3f} | {mfu} | "
      f"{gib} | {row['sync_overhead']:.2f}x |"
  )


def finite(row: dict) -> bool:
  """Whether every column of ``row`` is a finite number or, for MFU and memory, None (unknown)."""
  unknown = lambda c: c in ("mfu", "compiled_gib") and row[c] is None
  return all(unknown(c) or math.isfinite(row[c]) for c in COLUMNS)


def names(choices) -> Callable[[str], list[str]]:
  """An argparse ``type``: a comma-separated list of ``choices``; anything else is a usage error.

  Example:
    >>> names(DTYPES)("bfloat16,float32")
    ['bfloat16', 'float32']
    >>> names(DTYPES)("fp16")
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


@cli.command
def main(argv=None):
  parser = cli.Parser("python -m benchmarks.accelerator", __doc__)
  parser.add_argument("--sizes", type=names(llama.PRESETS), default="tiny", help="e.g. 1b")
  parser.add_argument(
      "--optimizers", type=names(optimizers.OPTIMIZERS), default="adamw,kron,shampoo,muon"
  )
  parser.add_argument("--dtypes", type=names(DTYPES), default=",".join(DTYPES))
  parser.add_argument("--steps", type=int, default=20, help="timed steps in each loop")
  parser.add_argument("--repeats", type=int, default=2, help="turns of each loop; the fastest")
  args = parser.parse_args(argv)
  if min(args.steps, args.repeats) < 1:
    parser.error(f"--steps {args.steps} --repeats {args.repeats}: each must be at least 1")
  jax.config.update("jax_num_cpu_devices", 8)  # The CPU backend only; GPUs and TPUs are as found.
  device = jax.devices()[0]
  print(
      f"jax {jax.__version__}, {jax.device_count()} x {device.device_kind} ({device.platform}); "
      f"{args.steps} timed steps per loop after {WARMUP} warm-up, fastest of {args.repeats} "
      "turns\n"
  )
  print(HEADER)
  print("|---" * (HEADER.count("|") - 1) + "|")
  for size, optimizer, dtype in itertools.product(args.sizes, args.optimizers, args.dtypes):
    row = measure(bench_config(size, optimizer, dtype, args.steps), args.steps, args.repeats)
    print(format_row(size, optimizer, dtype, row), flush=True)


if __name__ == "__main__":
  main()
