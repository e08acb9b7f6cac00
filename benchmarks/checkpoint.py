"""What a checkpoint costs the training loop: seconds blocked per save vs the time of one step.

  python -m benchmarks.checkpoint [--sizes tiny,small] [--saves 5]

For each model size (configs/lm.py, AdamW, 8 simulated CPU devices, batch 16) the
same jitted train step runs: first without saving (the time of one step), then
with an orbax save (trainers/rundir/checkpoint.py's manager) after each step. "blocked"
is the median time the loop thread spends inside ``save`` (after the previous save's
write has finished, as it has in a run saving every ``config.ckpt_steps``); "copy" is
the median device-to-host copy of the same state in the same run (``jax.device_get``,
timed alone just before each save), and "blocked / copy" their ratio: what the loop
pays beyond the copy while orbax's background thread writes. The synchronous save
(async off) is the baseline.
Prints a markdown table.
"""

import os

from trainers import ONE_BLAS_THREAD

os.environ.setdefault(*ONE_BLAS_THREAD)

import tempfile
import time

import flax.linen as nn
import jax
import numpy as np

from benchmarks.throughput import init_state, lm_config, setup
from benchmarks.timing import WARMUP, seconds_per_step
from trainers import cli
from trainers.rundir import checkpoint


def state_mib(state) -> float:
  return sum(x.nbytes for x in jax.tree.leaves(state)) / 2**20


def measure(config, saves: int, use_async: bool) -> dict:
  """State MiB, seconds per step without saving, and seconds the loop is blocked per save."""
  mesh, run, train_step, batches = setup(config, WARMUP + 2 * saves)
  rules = nn.logical_axis_rules(config.sharding_rules)
  with jax.set_mesh(mesh), rules, tempfile.TemporaryDirectory() as d:
    state, step_s = seconds_per_step(train_step, init_state(run), batches, saves)
    manager = checkpoint.open_manager(os.path.join(d, "ckpt"), use_async=use_async)
    blocked, copies = [], []
    for i, batch in enumerate(batches[WARMUP + saves :]):
      state, loss = train_step(state, batch)
      jax.block_until_ready(loss)  # Time the save alone, not the step it waits for,
      manager.wait_until_finished()  # nor the previous save's background write.
      tick = time.perf_counter()
      jax.device_get(state)
      copies.append(time.perf_counter() - tick)
      tick = time.perf_counter()
      checkpoint.save(manager, i + 1, state, {"step": i + 1}, force=True)
      blocked.append(time.perf_counter() - tick)
    manager.close()
  return {
      "mib": state_mib(state),
      "step": step_s,
      "copy": np.median(copies),
      "blocked": np.median(blocked),
  }


@cli.command
def main(argv=None):
  parser = cli.Parser("python -m benchmarks.checkpoint", __doc__)
  parser.add_argument("--sizes", default="tiny,small")
  parser.add_argument("--saves", type=int, default=5, help="timed saves per measurement")
  args = parser.parse_args(argv)
  jax.config.update("jax_num_cpu_devices", 8)
  checkpoint.quiet_orbax()
  print(f"{jax.device_count()} {jax.devices()[0].platform} devices, AdamW, batch 16\n")
  print(
      "| size | state MiB | step s | device-to-host copy s | async save: loop blocked s "
      "| blocked / copy | blocked / step | sync save s | sync / step |"
  )
  print("|---|---|---|---|---|---|---|---|---|")
  for size in args.sizes.split(","):
    config = lm_config(size, "adamw")
    fast = measure(config, args.saves, use_async=True)
    sync = measure(config, args.saves, use_async=False)
    print(
        f"| {size} | {fast['mib']:.1f} | {fast['step']:.3f} | {fast['copy']:.3f} | "
        f"{fast['blocked']:.3f} | {fast['blocked'] / fast['copy']:.1f} | "
        f"{fast['blocked'] / fast['step']:.2f} | {sync['blocked']:.3f} | "
        f"{sync['blocked'] / fast['step']:.2f} |",
        flush=True,
    )


if __name__ == "__main__":
  main()
