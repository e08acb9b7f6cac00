"""Saves that do not stall the loop: the loop thread copies the state off the device, a
background thread hands the copy to orbax.

The train step donates the state, so a save must own its arrays before the next step is
dispatched: :func:`host_copy` copies every array into host memory in the loop thread (each
accelerator's shards into its ``pinned_host`` memory, the same sharding, all transfers started
at once; on the CPU backend, whose device memory is host memory, a copy there by one jitted
program, which orbax then reads in place), which is all the loop waits for.
:class:`BackgroundSaver` then runs the save (orbax's own setup, its threads, its per-leaf
bookkeeping: 0.03-0.09 s a save on the CPU hosts measured, docs/benchmarks.md) on one thread
of its own; a save's error is raised in the loop at
the next save or at :meth:`BackgroundSaver.wait`. On several processes too: the checkpoint
manager names every process, so orbax's barriers are the coordination service's rather than
device collectives, which would have to keep their order against the train steps'
(trainers/rundir/checkpoint.py).

The copy is the one full copy of the state a save holds: orbax serializes it in place (on the
CPU backend; from ``pinned_host`` memory on accelerators) and TensorStore, writing it
uncompressed (``checkpoint.tree_handler``), references it rather than encoding a second copy.
:func:`write_budget` caps the bytes being written at once (orbax's in-flight byte limit), so
that a write's in-flight buffers, whatever the kvstore, stay within a quarter of the state: a
save's peak extra host memory is the copy, orbax's per-leaf and per-shard bookkeeping
(a few KiB a shard) and at most that budget.

Example:
  >>> import jax.numpy as jnp
  >>> state = {"w": jnp.arange(4.0)}
  >>> copy = host_copy(state)
  >>> copy["w"] is not state["w"], float(copy["w"].sum())  # on CPU: a copy in device memory
  (True, 6.0)
  >>> saver = BackgroundSaver()
  >>> saver.submit(lambda tree: tree["w"].shape, copy)
  >>> saver.wait()
  (4,)
  >>> tree = [jax.ShapeDtypeStruct((128, 256), jnp.float32)] * 8  # 8 arrays of 128 KiB
  >>> write_budget(tree), write_budget(tree[:1])  # a quarter of 1 MiB; more than one array
  (262144, 131073)
"""

import concurrent.futures
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

HOST = "pinned_host"
WRITE_FRACTION = 0.25  # Of the tree's local bytes, being written at once during a save.


def host_copy(tree) -> Any:
  """``tree`` with every ``jax.Array`` copied into host memory, in the same shardings; returns
  once the copies are complete (the only part of a save the loop waits for)."""
  leaves, treedef = jax.tree.flatten(tree)
  at = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array)]
  for i, copy in zip(at, _copies([leaves[i] for i in at])):
    leaves[i] = copy
  return jax.block_until_ready(treedef.unflatten(leaves))


def _copies(arrays: list) -> list:
  """Copies of ``arrays``, all transfers started at once: into each accelerator's
  ``pinned_host`` memory (one ``device_put``), or, when every array is on CPU devices, whose
  memory is host memory, by one jitted program (a few ms where a ``device_put`` per array
  takes tens: one dispatch per device instead of one per shard)."""
  apart = [_host_memory_apart(next(iter(x.sharding.device_set))) for x in arrays]
  if not any(apart):
    return _copy_in_place(tuple(x.sharding for x in arrays))(arrays)
  kinds = [x.sharding.with_memory_kind(HOST) if a else x.sharding for x, a in zip(arrays, apart)]
  return jax.device_put(arrays, kinds, may_alias=False)


@functools.cache
def _copy_in_place(shardings: tuple) -> Callable[[list], list]:
  """One jitted copy of arrays in ``shardings`` into the same shardings (compiled once)."""
  return jax.jit(lambda arrays: [jnp.copy(x) for x in arrays], out_shardings=list(shardings))


@functools.cache
def _host_memory_apart(device) -> bool:
  """Whether ``device`` (not a CPU) has a ``pinned_host`` memory to copy into."""
  kinds = {memory.kind for memory in device.addressable_memories()}
  return device.platform != "cpu" and HOST in kinds


def write_budget(tree) -> int:
  """Bytes a save of ``tree`` (arrays, or ``ShapeDtypeStruct``s with shardings) may have in
  flight: ``WRITE_FRACTION`` of the bytes of the distinct shards this process holds, and more
  than its largest shard (orbax writes a shard at once and refuses one above its limit)."""
  shards = [size for x in jax.tree.leaves(tree) for size in _local_shard_bytes(x)]
  return max(int(WRITE_FRACTION * sum(shards)), max(shards, default=0) + 1)


def local_bytes(tree) -> int:
  """Bytes of the distinct shards of ``tree``'s arrays this process holds, each once.

  Example: ``local_bytes([jax.ShapeDtypeStruct((4,), jnp.float32)])`` == 16.
  """
  return sum(size for x in jax.tree.leaves(tree) for size in _local_shard_bytes(x))


def _local_shard_bytes(x) -> list[int]:
  """Bytes of each distinct shard of ``x`` on this process's devices (one if unsharded)."""
  shape, itemsize = tuple(x.shape), x.dtype.itemsize
  sharding = getattr(x, "sharding", None)
  if sharding is None:
    return [math.prod(shape) * itemsize]
  indices = sharding.addressable_devices_indices_map(shape).values()
  distinct = {tuple((s.start, s.stop) for s in index) for index in indices}
  return [math.prod(sharding.shard_shape(shape)) * itemsize] * len(distinct)


class BackgroundSaver:
  """Runs one save at a time on a thread of its own; the next waits for the previous."""

  def __init__(self):
    self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="checkpoint-save")
    self.pending: concurrent.futures.Future | None = None

  def submit(self, save: Callable, *args) -> None:
    """Waits for the previous save (raising its error), then starts ``save(*args)``."""
    self.wait()
    self.pending = self.pool.submit(save, *args)

  def wait(self) -> Any:
    """The last save's result once it returned (None if none); raises its error."""
    pending, self.pending = self.pending, None
    return None if pending is None else pending.result()

  def shutdown(self) -> None:
    """Stops the thread once a save running has returned; nothing more can be submitted."""
    self.pool.shutdown()
