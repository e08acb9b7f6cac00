"""Saves that do not stall the loop: the loop thread copies the state off the device, a
background thread hands the copy to orbax.

The train step donates the state, so a save must own its arrays before the next step is
dispatched: :func:`host_copy` copies every array into host memory in the loop thread (each
device's shards into its ``pinned_host`` memory, the same sharding, all transfers started at
once), which is all the loop waits for. :class:`BackgroundSaver` then runs the save (orbax's
own setup, its threads, its per-leaf bookkeeping: about 0.07-0.09 s a save on the CPU hosts
measured, docs/benchmarks.md) on one thread of its own; a save's error is raised in the loop at
the next save or at :meth:`BackgroundSaver.wait`. On several processes saves stay in the loop
thread (orbax's collectives must keep their order against the train steps').

Example:
  >>> import jax.numpy as jnp
  >>> state = {"w": jnp.arange(4.0)}
  >>> copy = host_copy(state)
  >>> copy["w"].sharding.memory_kind, float(copy["w"].sum())
  ('pinned_host', 6.0)
  >>> saver = BackgroundSaver()
  >>> saver.submit(lambda tree: tree["w"].shape, copy)
  >>> saver.wait()
  (4,)
"""

import concurrent.futures
import functools
from collections.abc import Callable
from typing import Any

import jax

HOST = "pinned_host"


def host_copy(tree) -> Any:
  """``tree`` with every ``jax.Array`` copied into host memory, in the same shardings; returns
  once the copies are complete (the only part of a save the loop waits for)."""
  copies = jax.tree.map(_to_host, tree)
  return jax.block_until_ready(copies)


def _to_host(x):
  if not isinstance(x, jax.Array):
    return x
  if _has_host_memory(next(iter(x.sharding.device_set))):
    return jax.device_put(x, x.sharding.with_memory_kind(HOST))
  return jax.device_put(x, x.sharding, may_alias=False)  # A device without host memories.


@functools.cache
def _has_host_memory(device) -> bool:
  return HOST in {memory.kind for memory in device.addressable_memories()}


class BackgroundSaver:
  """Runs one save at a time on a thread of its own; the next waits for the previous.

  ``background=False`` (the trainer's choice on several processes) runs each save in the
  caller's thread: orbax's save runs collectives and barriers across processes, which must
  come in the same order as the train steps' on every process.
  """

  def __init__(self, background: bool = True):
    self.background = background
    self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="checkpoint-save")
    self.pending: concurrent.futures.Future | None = None

  def submit(self, save: Callable, *args) -> None:
    """Waits for the previous save (raising its error), then starts ``save(*args)``."""
    self.wait()
    if self.background:
      self.pending = self.pool.submit(save, *args)
    else:
      save(*args)

  def wait(self) -> Any:
    """The last save's result once it returned (None if none); raises its error."""
    pending, self.pending = self.pending, None
    return None if pending is None else pending.result()
