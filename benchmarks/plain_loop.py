"""The loop a user writes by hand: the baseline the trainer's step is measured against.

The same model, task, batch, dtypes, microbatches and optax chain as the trainer's run of a
config (the registry's optimizer, clipping and weight decay included), but no plan, no
state-dtype wrapper and no metrics: params and optimizer state on the default device,
``jax.jit`` with the state donated, a new host batch each step, gradients summed over the
microbatches in float32 by a ``lax.scan``.

  python -m benchmarks.plain_loop --size 125m --optimizer adamw

Example:
  >>> from configs import lm
  >>> loop = PlainLoop(lm.get_config("size=tiny"))
  >>> loop.figures().arguments > 0
  True
"""

import dataclasses
import itertools
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import bv_sharding as bvs
from trainers import build
from trainers.figures import memory
from trainers.optimizers import registry

WINDOW = 10  # Steps between two waits: the trainer reads its metrics every 10 steps too.


def chain(run: build.Run) -> optax.GradientTransformation:
  """The optax chain a user writes for ``run``'s config: the registry's optimizer with its
  clipping, weight decay and schedule, its state in the params' dtype."""
  config = run.config
  return registry.make_optimizer(
      config.optax_name,
      run.learning_rates["lr"],
      weight_decay=config.wd or 0.0,
      clip_norm=config.grad_clip_norm,
      **(config.optax or {}),
  )


def grads_fn(loss_fn: Callable, accum_steps: int) -> Callable:
  """``(params, batch) -> (loss, grads)`` over ``accum_steps`` microbatches of equal rows,
  their gradients summed in float32."""
  value_and_grad = jax.value_and_grad(loss_fn)
  if accum_steps == 1:
    return value_and_grad

  def split(x):
    return x.reshape(accum_steps, x.shape[0] // accum_steps, *x.shape[1:])

  def summed(params, batch):
    def add(sums, microbatch):
      loss, grads = value_and_grad(params, microbatch)
      return jax.tree.map(lambda s, g: s + g.astype(s.dtype), sums, (loss, grads)), None

    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), (jnp.zeros(()), params))
    (loss, grads), _ = jax.lax.scan(add, zeros, jax.tree.map(split, batch))
    mean = lambda s, p: (s / accum_steps).astype(p.dtype)
    return loss / accum_steps, jax.tree.map(mean, grads, params)

  return summed


@dataclasses.dataclass
class PlainLoop:
  """``config``'s model, task and chain in a hand-written loop on the default device."""

  config: Any

  def __post_init__(self):
    mesh = bvs.make_mesh([("data", 1)], devices=jax.devices()[:1])
    self.run = build.build(self.config, mesh)
    self.tx = chain(self.run)
    loss_fn = build.loss_fn(self.run.task, self.run.model)
    grads = grads_fn(loss_fn, self.config.grad_accum_steps)

    def step(params, opt, batch):
      loss, g = grads(params, batch)
      updates, opt = self.tx.update(g, opt, params)
      return optax.apply_updates(params, updates), opt, loss

    self.step = jax.jit(step, donate_argnums=(0, 1))

  def abstract(self) -> tuple:
    """``(params, opt, batch)`` as ``jax.ShapeDtypeStruct``s: what the step compiles for."""
    params = nn.unbox(jax.eval_shape(self.run.init))
    return params, jax.eval_shape(self.tx.init, params), self.run.batch_shapes

  def figures(self) -> memory.StepMemory | None:
    """XLA's memory figures of the compiled step (nothing allocated)."""
    return memory.StepMemory.of(self.step.lower(*self.abstract()).compile())

  def batches(self) -> Iterator:
    """The run's host batches, a new one each step."""
    config = self.config
    return self.run.task.batches(self.run.task.train, global_batch=config.batch_size, seed=0)

  def window_seconds(self, num_windows: int) -> list[float]:
    """Seconds per step of ``num_windows`` windows of ``WINDOW`` steps, after ``WINDOW``
    untimed steps (the first compiles); the loop waits for the device once per window."""
    params = jax.jit(lambda: nn.unbox(self.run.init()))()
    opt = jax.jit(self.tx.init)(params)
    batches = self.batches()
    times = []
    for _ in range(num_windows + 1):
      for batch in itertools.islice(batches, WINDOW):
        params, opt, loss = self.step(params, opt, batch)
      jax.block_until_ready(loss)
      times.append(time.perf_counter())
    return [(b - a) / WINDOW for a, b in itertools.pairwise(times)]


def median_step(windows: list[float]) -> float:
  """The median of the windows' seconds per step.

  Example:
    >>> median_step([0.5, 0.2, 0.3])
    0.3
  """
  return statistics.median(windows)
