"""What a checkpoint costs the training loop: seconds blocked per save vs the device-to-host copy.

  python -m benchmarks.checkpoint [--sizes tiny,small,medium] [--saves 5] [--restores 5]
      [--tables saves,restores]

For each model size (configs/lm.py, AdamW, 8 simulated CPU devices, batch 16) the same jitted
train step runs, then saves after each step, two ways in the same run: "orbax async" calls
orbax's async ``save`` in the loop thread (the trainer before), "trainer" is
``Checkpoints.step_done`` as the trainer calls it (the loop copies the state to host memory,
a background thread hands it to orbax, which encodes and writes at most a quarter of it at
once: trainers/rundir/saver.py). "blocked" is the median time the loop thread spends in the
save (after the previous save's write has finished, as it has in a run saving every
``config.ckpt_steps``; each way's first save is untimed); "copy" the median device-to-host copy
of the same state in the same run (``jax.device_get``, timed alone just before each save); "written" the
median time from the save's start until its write is complete; "extra host memory" the peak rise
of the process's resident memory during a save and its write above the memory in use at its
start (free heap pages are released before the copy and before the save, so neither reuses the
pages of the one before unseen; sampled every millisecond), as a multiple of the state's bytes
this process holds; "of which bookkeeping" the same for the trainer's save of the state's
skeleton (the same leaves, shardings and shards, one element each: what orbax and TensorStore
keep per leaf and per shard whatever the bytes). Prints a markdown table.

A second table: what checking a checkpoint's integrity costs. The state (params and optimizer
state) is restored as the trainer restores it (``trainers.start.restore``: the meta item, the
params' check) with and without verification (``verify``: each array read in its saved dtype
and checked against the checksum saved with it, ``trainers/rundir/checksums.py``), taking turns
(an untimed first of each; each turn starts with another way), and as orbax alone reads its two
items, for scale; the medians, the cost of verification as a fraction of the unverified restore
(of the medians, and of the fastest of each), and the median time of the
checksums a save computes in the loop thread, as a fraction of the trainer's save (the median
time the loop is blocked in ``Checkpoints.step_done``, the checksums included).
"""

import os

from trainers import ONE_BLAS_THREAD

os.environ.setdefault(*ONE_BLAS_THREAD)

import ctypes
import tempfile
import threading
import time
from unittest import mock

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from benchmarks.throughput import init_state, lm_config, setup
from benchmarks.timing import WARMUP, seconds_per_step
from trainers import start
from trainers.rundir import checkpoint, checksums, saver
from trainers.rundir.checkpoint import tree_restore
from trainers.settings import cli

PAGE = os.sysconf("SC_PAGE_SIZE")
# Untimed saves each way first: they compile the trainer's copy and start orbax's threads, once
# a run (as the first steps compile the train step).
FIRST_SAVES = 1


def rss() -> int:
  with open("/proc/self/statm") as f:
    return int(f.read().split()[1]) * PAGE


def release_free_memory() -> None:
  """Returns the C heap's free pages to the system (glibc's ``malloc_trim``; elsewhere nothing),
  so that resident memory is the memory in use, not pages an earlier copy freed and the heap
  kept (which the next copy would reuse unseen)."""
  try:
    ctypes.CDLL(None).malloc_trim(0)
  except AttributeError:  # Not glibc.
    pass


class PeakMemory:
  """The peak resident memory above the memory in use at entry, sampled every millisecond."""

  def __enter__(self):
    release_free_memory()
    self.base = self.peak = rss()
    self.done = threading.Event()
    self.thread = threading.Thread(target=self._sample, daemon=True)
    self.thread.start()
    return self

  def _sample(self):
    while not self.done.wait(0.001):
      self.peak = max(self.peak, rss())

  def __exit__(self, *exc):
    self.done.set()
    self.thread.join()
    self.extra = max(self.peak, rss()) - self.base


def skeleton(state):
  """``state`` with every shard cut to one element, in the same shardings: the same leaves
  and shards to save, next to no bytes.

  Example:
    >>> rows = jax.NamedSharding(jax.make_mesh((8,), ("data",)), jax.P("data"))
    >>> bare = skeleton({"w": jax.device_put(jnp.ones((64, 3)), rows)})["w"]
    >>> bare.shape, bare.sharding == rows, len(bare.addressable_shards)
    ((8, 1), True, 8)
  """

  def cut(x):
    shards = zip(x.shape, x.sharding.shard_shape(x.shape))
    return jnp.zeros(tuple(n // shard for n, shard in shards), x.dtype, device=x.sharding)

  return jax.tree.map(cut, state)


def save_memory(ckpt, step: int, state) -> int:
  """Peak extra host bytes of ``ckpt``'s save of ``state`` at ``step`` and its write."""
  with PeakMemory() as memory:
    ckpt.step_done(step, state)
    ckpt.saver.wait()
    ckpt.manager.wait_until_finished()
  return memory.extra


def measure(config, saves: int) -> dict:
  """State MiB, step s, copy s, and per way of saving: blocked s and peak extra host bytes."""
  config.ckpt_steps, config.total_steps = 1, 10**6
  mesh, run, step, batches = setup(config, WARMUP + 3 * saves + 2 * FIRST_SAVES)
  train_step = step.train
  rules = nn.logical_axis_rules(config.sharding_rules)
  timed = {"orbax": ([], [], []), "trainer": ([], [], [])}
  copies = []
  with jax.set_mesh(mesh), rules, tempfile.TemporaryDirectory() as d:
    state, step_s = seconds_per_step(train_step, init_state(run), batches, saves)
    manager = checkpoint.open_manager(os.path.join(d, "orbax"))
    ckpt = checkpoint.Checkpoints(os.path.join(d, "trainer"), config, run.migration, run.plan)
    for i, batch in enumerate(batches[WARMUP + saves :]):
      state, loss = train_step(state, batch)
      jax.block_until_ready(loss)  # Time the save alone, not the step it waits for,
      manager.wait_until_finished()  # nor the previous save's background write.
      ckpt.saver.wait()
      ckpt.manager.wait_until_finished()
      release_free_memory()  # The copy, as the save after it, allocates afresh.
      tick = time.perf_counter()
      jax.device_get(state)
      copy_s = time.perf_counter() - tick
      way = "orbax" if i % 2 else "trainer"
      with PeakMemory() as memory:
        tick = time.perf_counter()
        if way == "orbax":
          checkpoint.save(manager, i + 1, state, {"step": i + 1}, force=True)
        else:
          ckpt.step_done(i + 1, state)
        blocked = time.perf_counter() - tick
        ckpt.saver.wait()
        (manager if way == "orbax" else ckpt.manager).wait_until_finished()
        written = time.perf_counter() - tick
      if i >= 2 * FIRST_SAVES:
        copies.append(copy_s)
        timed[way][0].append(blocked)
        timed[way][1].append(memory.extra)
        timed[way][2].append(written)
    bare, step = skeleton(state), len(batches)
    bookkeeping = [save_memory(ckpt, step + i, bare) for i in range(FIRST_SAVES + saves)]
    manager.close()
    ckpt.close(state)
  found = {"mib": saver.local_bytes(state) / 2**20, "step": step_s, "copy": np.median(copies)}
  for way, (blocked, extra, written) in timed.items():
    found[way], found[f"{way} write"] = np.median(blocked), np.median(written)
    found[f"{way} memory"] = max(extra)
  found["bookkeeping"] = max(bookkeeping[FIRST_SAVES:])
  return found


def measure_restore(config, restores: int) -> dict:
  """Median seconds of restoring a saved state as the trainer does (``start.restore``)
  with verification ("checked") and without ("unchecked"), and as orbax alone reads its two
  items ("orbax"); of the checksums of the state ("sums": dispatched and fetched); of the time
  the loop is blocked in the trainer's save (``Checkpoints.step_done``, after the previous
  write finished) with its checksums ("save") and without ("unchecked save"); and the fastest
  of each ("<way> best"). The ways take turns, each turn starting with another, after an
  untimed first of each."""
  config.ckpt_steps, config.total_steps = 1, 10**6
  mesh, run, _, _ = setup(config, 1)
  target = run.plan.abstract()
  with jax.set_mesh(mesh), tempfile.TemporaryDirectory() as d:
    state = init_state(run)
    ckpt = checkpoint.Checkpoints(d, config, run.migration, run.plan)
    ckpt.close(state)
    manager = checkpoint.open_manager(ckpt.directory, read_only=True)
    step = manager.latest_step()
    saves = checkpoint.Checkpoints(os.path.join(d, "saves"), config, run.migration, run.plan)
    steps = iter(range(1, 10**6))

    def timed(work):
      tick = time.perf_counter()
      jax.block_until_ready(work())
      return time.perf_counter() - tick

    def save(verify: bool) -> float:
      saves.saver.wait()
      saves.manager.wait_until_finished()  # The previous save's write is not timed.
      with mock.patch.object(checksums, "start", checksums.start if verify else lambda _: dict):
        return timed(lambda: saves.step_done(next(steps), state))

    read = lambda verify: start.restore(
        manager, step, run.plan, run.tx, run.migration, verify=verify
    )[0]
    orbax = lambda: [
        manager.restore(step, args=ocp.args.Composite(**{item: tree_restore(target[item])}))[item]
        for item in (checkpoint.PARAMS, checkpoint.OPT)
    ]
    ways = {
        "orbax": lambda: timed(orbax),
        "unchecked": lambda: timed(lambda: read(False)),
        "checked": lambda: timed(lambda: read(True)),
        "sums": lambda: timed(lambda: checksums.of(state)),
        "save": lambda: save(True),
        "unchecked save": lambda: save(False),
    }
    found = {way: [] for way in ways}
    for i in range(restores + 1):
      turn = list(ways.items())
      for way, measure_way in turn[i % len(turn) :] + turn[: i % len(turn)]:
        seconds = measure_way()
        if i:
          found[way].append(seconds)
    saves.close(state)
    manager.close()
  best = {f"{way} best": float(np.min(t)) for way, t in found.items()}
  return {way: float(np.median(t)) for way, t in found.items()} | best


def multiple(extra: int, state_mib: float) -> str:
  """``extra`` bytes as a multiple of the state, and in MiB.

  Example: ``multiple(3 * 2**20, 2.0)`` == "1.50 (3.0 MiB)".
  """
  return f"{extra / (state_mib * 2**20):.2f} ({extra / 2**20:.1f} MiB)"


@cli.command
def main(argv=None):
  parser = cli.Parser("python -m benchmarks.checkpoint", __doc__)
  parser.add_argument("--sizes", default="tiny,small,medium")
  parser.add_argument("--saves", type=int, default=5, help="timed saves per way of saving")
  parser.add_argument("--restores", type=int, default=5, help="timed restores per way")
  parser.add_argument(
      "--tables", default="saves,restores", help="the tables to measure: saves, restores or both"
  )
  args = parser.parse_args(argv)
  tables = set(args.tables.split(","))
  jax.config.update("jax_num_cpu_devices", 8)
  checkpoint.quiet_orbax()
  print(f"{jax.device_count()} {jax.devices()[0].platform} devices, AdamW, batch 16\n")
  sizes = args.sizes.split(",")
  for name, (header, row, measured, count) in {
      "saves": (SAVE_HEADER, save_row, measure, args.saves),
      "restores": (RESTORE_HEADER, restore_row, measure_restore, args.restores),
  }.items():
    if name in tables:
      rows = [
          lambda size=size, row=row, measured=measured, count=count: row(
              size, measured(lm_config(size, "adamw"), count)
          )
          for size in sizes
      ]
      table(header, rows)
      print()


SAVE_HEADER = (
    "size | state MiB | step s | copy s | orbax async: blocked s | blocked / copy | written s "
    "| extra host memory / state | trainer: blocked s | blocked - copy ms | written s "
    "| extra host memory / state | of which bookkeeping"
)
RESTORE_HEADER = (
    "size | orbax restore s | trainer's restore s | with verification s | verification / "
    "restore (best of) | checksums ms | checksums / restore (best of) | save blocked ms | "
    "with checksums ms | checksums add to a save"
)


def table(header: str, rows: list) -> None:
  """A markdown table of ``header``'s columns ("a | b"), each row printed as it is measured
  (``rows``: functions returning its cells)."""
  print(f"| {header} |\n|{'---|' * (header.count('|') + 1)}", flush=True)
  for row in rows:
    print(f"| {' | '.join(row())} |", flush=True)


def save_row(size: str, m: dict) -> list[str]:
  return [
      size,
      f"{m['mib']:.1f}",
      f"{m['step']:.3f}",
      f"{m['copy']:.3f}",
      f"{m['orbax']:.3f}",
      f"{m['orbax'] / m['copy']:.1f}",
      f"{m['orbax write']:.2f}",
      multiple(m["orbax memory"], m["mib"]),
      f"{m['trainer']:.3f}",
      f"{1000 * (m['trainer'] - m['copy']):+.0f}",
      f"{m['trainer write']:.2f}",
      multiple(m["trainer memory"], m["mib"]),
      multiple(m["bookkeeping"], m["mib"]),
  ]


def restore_row(size: str, r: dict) -> list[str]:
  return [
      size,
      f"{r['orbax']:.3f}",
      f"{r['unchecked']:.3f}",
      f"{r['checked']:.3f}",
      f"{r['checked'] / r['unchecked'] - 1:+.1%} ({r['checked best'] / r['unchecked best'] - 1:+.1%})",
      f"{1000 * r['sums']:.1f}",
      f"{r['sums'] / r['unchecked']:.1%} ({r['sums best'] / r['unchecked best']:.1%})",
      f"{1000 * r['unchecked save']:.1f}",
      f"{1000 * r['save']:.1f}",
      f"{r['save'] / r['unchecked save'] - 1:+.1%}",
  ]


if __name__ == "__main__":
  main()
