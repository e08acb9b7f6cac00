"""Timing a jitted train step: compile and warm up first, then the mean of the timed steps.

Example:
  >>> import jax.numpy as jnp
  >>> step = lambda state, batch: (state + batch, (state + batch).sum())
  >>> state, seconds = seconds_per_step(step, jnp.zeros(2), iter([jnp.ones(2)] * 5), 3)
  >>> state.tolist(), seconds > 0
  ([5.0, 5.0], True)
"""

import time
from collections.abc import Callable, Iterable
from typing import Any

import jax

WARMUP = 2  # Steps run before timing: the first compiles, the second settles the caches.


def seconds_per_step(
    train_step: Callable, state: Any, batches: Iterable, num_steps: int, warmup: int = WARMUP
) -> tuple[Any, float]:
  """``(state, mean seconds of num_steps steps)`` after ``warmup`` untimed steps of ``batches``.

  Only the last step is waited for: the steps are dispatched back to back.
  """
  batches = iter(batches)
  for _, batch in zip(range(warmup), batches):
    state, _ = train_step(state, batch)
  jax.block_until_ready(state)
  start = time.perf_counter()
  for _, batch in zip(range(num_steps), batches):
    state, _ = train_step(state, batch)
  jax.block_until_ready(state)
  return state, (time.perf_counter() - start) / num_steps
