"""Does reading a token file stall the step? File-backed, prefetched input vs in-memory batches.

  python -m benchmarks.input [--steps 10] [--rounds 8] [--batch_size 32] [--seq_len 128]

On 8 simulated CPU devices, configs/lm.py's tiny Llama trains from a token file
written here (random uint16 ids, --file_mib MiB, memory-mapped) in three ways,
with the same train step and the same batches (steps of one (seed, step) order):
  in-memory   every batch already a global jax.Array on the devices (the floor);
  prefetch    trainers/input/prefetch.py: read and transferred in a background thread;
  inline      read and transferred in the loop, no prefetch.
Short rounds alternate the three (so a busy host slows all alike): the median
over the rounds of the mean step time, and of its ratio to the same round's
in-memory time.
Then the loader alone: this process's windows per second, as tokens/s (best of 5).
"""

import os

from trainers import ONE_BLAS_THREAD

os.environ.setdefault(*ONE_BLAS_THREAD)

import itertools
import statistics
import tempfile
import time

import flax.linen as nn
import jax
import numpy as np

import bv_sharding as bvs
from benchmarks.timing import WARMUP, seconds_per_step
from configs import lm
from trainers import build, steps
from trainers.input import batching, prefetch, sources, tasks
from trainers.settings import cli


def write_token_file(path: str, mib: int, vocab: int) -> None:
  """``mib`` MiB of random uint16 ids below ``vocab`` at ``path``, written in 16 MiB pieces."""
  rng = np.random.default_rng(0)
  with open(path, "wb") as f:
    for _ in range(mib // 16):
      rng.integers(0, vocab, 8 * 2**20, dtype=np.uint16).tofile(f)


def loader_tokens_per_sec(task, batch_size: int, seq_len: int, num_steps: int) -> float:
  """Tokens/s of this process's reads alone (``task.batches`` windows, no device), best of 5."""
  local = task.batches(task.train, global_batch=batch_size, seed=1)
  best = float("inf")
  for _ in range(5):
    start = time.perf_counter()
    for _ in range(num_steps):
      next(local)
    best = min(best, time.perf_counter() - start)
  return num_steps * batch_size // jax.process_count() * seq_len / best


@cli.command
def main(argv=None):
  parser = cli.Parser("python -m benchmarks.input", __doc__)
  parser.add_argument("--steps", type=int, default=10, help="timed steps per round")
  parser.add_argument("--rounds", type=int, default=8)
  parser.add_argument("--batch_size", type=int, default=32)
  parser.add_argument("--seq_len", type=int, default=128)
  parser.add_argument("--file_mib", type=int, default=256)
  args = parser.parse_args(argv)
  jax.config.update("jax_num_cpu_devices", 8)

  config = lm.get_config()
  config.seq_len, config.batch_size = args.seq_len, args.batch_size
  tmp = tempfile.TemporaryDirectory()
  path = os.path.join(tmp.name, "train.bin")
  write_token_file(path, args.file_mib, vocab=256)
  config.input = sources.input_config(kind="tokens", train=path, eval_fraction=0.01)
  mesh = bvs.make_mesh(config.mesh, axis_types=build.axis_types(config))
  run = build.build(config, mesh)
  task = run.task
  task.check(run.model)
  step = build.compile_step(run)
  sharding = step.batch_sharding
  local = lambda: task.batches(task.train, global_batch=config.batch_size, seed=0)
  count = WARMUP + args.steps
  inputs = {
      "in-memory": lambda: iter(
          [batching.to_global(b, sharding) for b in itertools.islice(local(), count)]
      ),
      "prefetch": lambda: prefetch.to_device(local(), sharding, task.prefetch),
      "inline": lambda: (batching.to_global(b, sharding) for b in local()),
  }
  times = {name: [] for name in inputs}
  with jax.set_mesh(mesh), nn.logical_axis_rules(config.sharding_rules):
    state = steps.init_state(run.init, run.tx, run.plan)
    for _, name in itertools.product(range(args.rounds), inputs):
      state, seconds = seconds_per_step(step.train, state, inputs[name](), args.steps)
      times[name].append(seconds)

  print(
      f"{jax.device_count()} {jax.devices()[0].platform} devices, configs/lm.py tiny, batch "
      f"{config.batch_size} x {config.seq_len + 1} tokens from a {args.file_mib} MiB uint16 file; "
      f"median of {args.rounds} rounds of {args.steps} steps\n"
  )
  print("| input | ms / step | vs in-memory |")
  print("|---|---|---|")
  for name, runs in times.items():
    ratio = statistics.median(a / b for a, b in zip(runs, times["in-memory"]))
    print(f"| {name} | {1e3 * statistics.median(runs):.1f} | {ratio:.3f} |")
  print("\n| loader (this process, host only) | tokens/s |")
  print("|---|---|")
  for batch_size, seq_len in ((config.batch_size, config.seq_len), (256, 1024)):
    rate = loader_tokens_per_sec(task_for(config, path, seq_len), batch_size, seq_len, 50)
    print(f"| {batch_size} x {seq_len + 1} windows | {rate / 1e6:.1f} M |")
  tmp.cleanup()


def task_for(config, path: str, seq_len: int):
  """The token-file task of ``config`` with windows of ``seq_len + 1``."""
  config = config.copy_and_resolve_references()
  config.seq_len = seq_len
  config.input = sources.input_config(kind="tokens", train=path, eval_fraction=0.01)
  return tasks.get_task(config)


if __name__ == "__main__":
  main()
