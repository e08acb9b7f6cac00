"""Deterministic per-process batches: token windows and images.

Every step's *global* batch is a pure function of (seed, step): its row ids are
drawn from ``np.random.default_rng((seed, step))``. Each process then reads only
its contiguous slice of rows, so 1 process x 8 devices and 2 processes x 4
devices see the same global batch, ``start_step`` resumes the exact order with no
iterator state, and ``to_global`` stitches the slices into global ``jax.Array``s.
The sources (token files, text, .npy images) are opened by trainers/input/sources.py.

Example:
  >>> import jax
  >>> from trainers.input import sources
  >>> train = sources.TokenStream((np.arange(1000, dtype=np.uint8),), ("bytes",))
  >>> it = text_batches(train, seq_len=16, global_batch=8, seed=0)
  >>> local = next(it)  # this process's rows: (8 // jax.process_count(), 17) int32
  >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
  >>> tokens = to_global(local, jax.sharding.NamedSharding(mesh, jax.P("data")))
  >>> local.shape, tokens.shape  # one process here: the global batch is the local one
  ((8, 17), (8, 17))
"""

import itertools
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import numpy as np

from trainers.errors import ConfigError


def local_rows(
    seed: int,
    step: int,
    global_batch: int,
    num_choices: int,
    process_index: int,
    process_count: int,
) -> np.ndarray:
  """Row ids (into ``num_choices`` rows) of this process's slice of a step.

  The global batch depends only on (seed, step); process p keeps rows
  [p * global_batch // process_count, (p + 1) * global_batch // process_count).

  Example: ``local_rows(0, 3, 8, 100, 1, 2)`` is the last 4 of the 8 ids that
  ``local_rows(0, 3, 8, 100, 0, 1)`` returns.
  """
  rows = np.random.default_rng((seed, step)).integers(0, num_choices, size=global_batch)
  per_process = global_batch // process_count
  return rows[process_index * per_process : (process_index + 1) * per_process]


def batches(
    take: Callable[[np.ndarray], Any],
    num_choices: int,
    *,
    global_batch: int,
    seed: int,
    start_step: int = 0,
    process_index: int | None = None,
    process_count: int | None = None,
) -> Iterator[Any]:
  """Infinite iterator of ``take(local_rows(...))`` for steps start_step, ...

  process_index / process_count default to jax's; global_batch must be
  divisible by process_count. ``start_step`` resumes a run deterministically.

  Example: ``next(batches(lambda ids: ids, 100, global_batch=4, seed=0))``.
  """
  if process_index is None:
    process_index = jax.process_index()
  if process_count is None:
    process_count = jax.process_count()
  check_batch_size(global_batch, process_count=process_count)
  return (
      take(local_rows(seed, step, global_batch, num_choices, process_index, process_count))
      for step in itertools.count(start_step)
  )


def text_batches(tokens, *, seq_len: int, **sampling) -> Iterator[np.ndarray]:
  """Yields int32 (local_batch, seq_len + 1) windows of a ``sources.TokenStream``.

  Only this process's windows are read. ``sampling`` are the keyword arguments of
  ``batches`` (global_batch, seed, ...). Inputs are ``w[:, :-1]``, targets ``w[:, 1:]``.

  Example: ``text_batches(train, seq_len=128, global_batch=32, seed=0)``.
  """
  return batches(
      lambda starts: tokens.windows(starts, seq_len + 1), len(tokens) - seq_len, **sampling
  )


def image_batches(split: dict, **sampling) -> Iterator[dict]:
  """Yields {"image", "label"} local batches of a split (``load_digits``, memmapped .npy).

  ``sampling`` are the keyword arguments of ``batches`` (global_batch, seed, ...).

  Example: ``image_batches(train, global_batch=64, seed=0)``.
  """
  take = lambda ids: {"image": split["image"][ids], "label": split["label"][ids].astype(np.int32)}
  return batches(take, len(split["label"]), **sampling)


def to_global(local_batch: Any, sharding: jax.sharding.Sharding) -> Any:
  """Assembles every leaf of this process's rows into a global jax.Array.

  Example: ``to_global(local, NamedSharding(mesh, P("data")))``.
  """
  return jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, x), local_batch)


def global_shapes(local_batch: Any, global_batch: int) -> Any:
  """The global batch's ``jax.ShapeDtypeStruct``s, of which ``local_batch`` holds this process's
  rows: each leaf's shape with dim 0 ``global_batch``.

  Example:
    >>> global_shapes({"tokens": np.zeros((4, 129), np.int32)}, 32)
    {'tokens': ShapeDtypeStruct(shape=(32, 129), dtype=int32)}
  """
  return jax.tree.map(
      lambda x: jax.ShapeDtypeStruct((global_batch, *x.shape[1:]), x.dtype), local_batch
  )


def check_batch_size(
    batch_size: int, mesh=None, axes: Sequence[str] = (), process_count: int = 1
) -> None:
  """Raises ``ConfigError`` unless ``batch_size`` splits evenly over the data axes and the processes.

  The one place batch divisibility is checked: the trainer calls it with the mesh
  before anything is allocated, ``batches`` without one (processes only).

  Example:
    >>> from bv_sharding import make_abstract_mesh
    >>> check_batch_size(32, make_abstract_mesh([("data", -1)], 8), ("data",), 2)
    >>> check_batch_size(30, make_abstract_mesh([("data", -1)], 8), ("data",), 1)
    Traceback (most recent call last):
    ...
    bv_sharding.errors.ConfigError: config.batch_size=30 must be a positive multiple of 8: ...
  """
  shards = math.prod(mesh.shape[a] for a in axes) if mesh is not None else 1
  need = math.lcm(shards, process_count)
  if batch_size <= 0 or batch_size % need:
    over = f"the data axes {tuple(axes)} span {shards} devices and " if mesh is not None else ""
    raise ConfigError(
        f"config.batch_size={batch_size} must be a positive multiple of {need}: {over}there are "
        f"{process_count} processes; use e.g. --config.batch_size={max(need, batch_size // need * need)}"
    )
