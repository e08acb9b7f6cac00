"""Input that never stalls the step: batches read and transferred in a background thread.

``to_device`` runs the per-process batch iterator in a thread that reads each
step's rows and assembles them into global ``jax.Array``s with the batch sharding
(``jax.make_array_from_process_local_data`` starts the host-to-device copies), at
most ``depth`` steps ahead of the train loop. The order is the iterator's, so the
batches stay a pure function of (seed, step).

In the train loop::

  local = batching.text_batches(train, seq_len=128, global_batch=32, seed=0, start_step=k)
  for step, batch in zip(range(k + 1, total + 1), to_device(local, sharding, depth=2)):
    state, loss = train_step(state, batch)

Example:
  >>> import jax
  >>> import numpy as np
  >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
  >>> sharding = jax.sharding.NamedSharding(mesh, jax.P("data"))
  >>> local = (np.full((8, 4), step) for step in range(3))
  >>> ready = list(to_device(local, sharding, depth=2))  # in order, already on the devices
  >>> [int(np.asarray(batch)[0, 0]) for batch in ready], ready[0].sharding == sharding
  ([0, 1, 2], True)
"""

import queue
import threading
from collections.abc import Iterator
from typing import Any

import jax

from trainers.input import batching

_DONE = object()


def _put(out: queue.Queue, item: Any, stop: threading.Event) -> bool:
  """Puts ``item`` into ``out`` once there is room; False if ``stop`` is set first."""
  while not stop.is_set():
    try:
      out.put(item, timeout=0.1)
      return True
    except queue.Full:
      continue
  return False


def _produce(batches: Iterator, sharding, out: queue.Queue, stop: threading.Event) -> None:
  """Puts global batches (then _DONE, or the exception raised) into ``out`` until ``stop``."""
  try:
    for local in batches:
      if not _put(out, batching.to_global(local, sharding), stop):
        return
    _put(out, _DONE, stop)
  except Exception as e:
    _put(out, e, stop)


def to_device(
    batches: Iterator[Any], sharding: jax.sharding.Sharding, depth: int = 2
) -> Iterator[Any]:
  """Yields ``batching.to_global(b, sharding)`` for each b of ``batches``, ``depth`` steps prefetched.

  The thread starts at the first ``next`` and stops when the generator is closed
  or collected; an exception in it is raised here.

  Example: ``next(to_device(iter([np.zeros((8, 4))]), NamedSharding(mesh, P("data"))))``.
  """
  out, stop = queue.Queue(maxsize=depth), threading.Event()
  thread = threading.Thread(
      target=_produce, args=(batches, sharding, out, stop), name="prefetch", daemon=True
  )
  thread.start()
  try:
    while (item := out.get()) is not _DONE:
      if isinstance(item, Exception):
        raise item
      yield item
  finally:
    stop.set()
    thread.join()
