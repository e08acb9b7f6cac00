"""The loop a user writes by hand: the baseline the trainer's step is measured against.

The same model, task, batch, dtypes, microbatches and optax chain as the trainer's run of a
config (the registry's optimizer, clipping, weight decay and schedule), but no plan and no
metrics. Params and optimizer state are replicated on this host's devices and each batch is
split over them (plain data parallelism; one device: all of it there). The step is
``jax.jit`` with the state donated. Each step gets a new host batch. Gradients are summed over
the microbatches in float32 by a ``lax.scan``; microbatch ``i`` holds rows ``i, i + k, ...``
of ``k``, as in the trainer. The optimizer state is stored in the config's ``state_dtype``
(``bv_sharding.optimizers.with_state_dtype``) only where it differs from the params' dtype.

Timing (:meth:`PlainLoop.window_seconds`): ``WINDOW`` untimed steps (the first compiles), then
windows of ``WINDOW`` steps, the device waited for at the end of each.

  python -m benchmarks.plain_loop --size 125m --optimizer adamw --windows 3

Example:
  >>> from configs import lm
  >>> loop = PlainLoop(lm.get_config("size=tiny"))
  >>> loop.figures().arguments > 0
  True
"""

import os

from trainers import ONE_BLAS_THREAD

os.environ.setdefault(*ONE_BLAS_THREAD)

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
from configs import lm
from trainers import build, optimizers, precision
from trainers.figures import memory
from trainers.models import llama
from trainers.optimizers import registry
from trainers.settings import cli

WINDOW = 10  # Steps between two waits: the trainer reads its metrics every 10 steps too.


def chain(run: build.Run) -> optax.GradientTransformation:
  """The optax chain a user writes for ``run``'s config: the registry's optimizer with its
  clipping, weight decay and schedule; its state stored in ``config.state_dtype`` where that
  differs from the params' dtype."""
  config = run.config
  tx = registry.make_optimizer(
      config.optax_name,
      run.learning_rates["lr"],
      weight_decay=config.wd or 0.0,
      clip_norm=config.grad_clip_norm,
      **(config.optax or {}),
  )
  dtypes = precision.of_config(config)
  return tx if dtypes.state == dtypes.param else bvs.optimizers.with_state_dtype(tx, dtypes.state)


def microbatches(batch, accum_steps: int):
  """``batch`` as ``accum_steps`` stacked microbatches; microbatch ``i`` holds rows ``i, i + k,
  ...`` (``k = accum_steps``), so each device splits its own rows.

  Example:
    >>> microbatches(jnp.arange(6), 2).tolist()
    [[0, 2, 4], [1, 3, 5]]
  """

  def split(x):
    return x.reshape(x.shape[0] // accum_steps, accum_steps, *x.shape[1:]).swapaxes(0, 1)

  return jax.tree.map(split, batch)


def grads_fn(loss_fn: Callable, accum_steps: int) -> Callable:
  """``(params, batch) -> (loss, grads)`` over ``accum_steps`` microbatches
  (:func:`microbatches`), their gradients summed in float32.

  Example:
    >>> loss, grads = grads_fn(lambda w, x: jnp.mean(w * x), 2)(1.0, jnp.arange(4.0))
    >>> float(loss), float(grads)
    (1.5, 1.5)
  """
  value_and_grad = jax.value_and_grad(loss_fn)
  if accum_steps == 1:
    return value_and_grad

  def summed(params, batch):
    def add(sums, microbatch):
      loss, grads = value_and_grad(params, microbatch)
      return jax.tree.map(lambda s, g: s + g.astype(s.dtype), sums, (loss, grads)), None

    zeros = jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), jnp.float32), (0.0, params))
    (loss, grads), _ = jax.lax.scan(add, zeros, microbatches(batch, accum_steps))
    mean = lambda s, p: (s / accum_steps).astype(jnp.result_type(p))
    return loss / accum_steps, jax.tree.map(mean, grads, params)

  return summed


@dataclasses.dataclass
class PlainLoop:
  """``config``'s model, task and chain in a hand-written data-parallel loop (module docstring)
  on ``num_devices`` of this host's devices (0: all).

  ``losses``: the loss at each wait of :meth:`window_seconds`, the untimed steps' included.
  """

  config: Any
  num_devices: int = 0  # The first this many of this host's devices; 0: all of them.

  def __post_init__(self):
    mesh = bvs.make_mesh([("data", 1)], devices=jax.devices()[:1])
    self.run = build.build(self.config, mesh)  # For its model, task and schedule; no plan.
    self.tx = chain(self.run)
    self.losses: list[float] = []
    auto = (jax.sharding.AxisType.Auto,)  # Shardings as jit propagates them, none in the types.
    chosen = jax.devices()[: self.num_devices or None]
    devices = jax.make_mesh((len(chosen),), ("data",), axis_types=auto, devices=chosen)
    same, split = (jax.NamedSharding(devices, jax.P(*axes)) for axes in ((), ("data",)))
    grads = grads_fn(build.loss_fn(self.run.task, self.run.model), self.config.grad_accum_steps)

    def step(params, opt, batch):
      loss, g = grads(params, batch)
      updates, opt = self.tx.update(g, opt, params)
      return optax.apply_updates(params, updates), opt, loss

    self.replicated, self.split = same, split
    self.step = jax.jit(
        step, in_shardings=(same, same, split), out_shardings=same, donate_argnums=(0, 1)
    )

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

  def init(self) -> tuple:
    """``(params, opt)``: the run's initial params and the chain's state, replicated."""
    params = jax.jit(lambda: nn.unbox(self.run.init()), out_shardings=self.replicated)()
    return params, jax.jit(self.tx.init, out_shardings=self.replicated)(params)

  def window_seconds(self, num_windows: int) -> list[float]:
    """Seconds per step of ``num_windows`` windows of ``WINDOW`` steps, after ``WINDOW``
    untimed steps (the first compiles); the loop waits for the device once per window."""
    params, opt = self.init()
    batches, marks = self.batches(), []
    for _ in range(num_windows + 1):
      for batch in itertools.islice(batches, WINDOW):
        params, opt, loss = self.step(params, opt, batch)
      marks.append(wait((params, opt)))
      self.losses.append(float(loss))
    return per_step(marks)


def wait(tree) -> float:
  """The time once every array of ``tree`` is ready (``time.perf_counter``).

  Example:
    >>> wait(jnp.ones(2)) > 0
    True
  """
  jax.block_until_ready(tree)
  return time.perf_counter()


def per_step(marks: list[float]) -> list[float]:
  """Seconds per step of each window between two consecutive ``marks`` (``WINDOW`` steps each).

  Example:
    >>> per_step([1.0, 3.0, 4.0])
    [0.2, 0.1]
  """
  return [(b - a) / WINDOW for a, b in itertools.pairwise(marks)]


def median_step(windows: list[float]) -> float:
  """The median of the windows' seconds per step.

  Example:
    >>> median_step([0.5, 0.2, 0.3])
    0.3
  """
  return statistics.median(windows)


@cli.command
def main(argv=None):
  parser = cli.Parser("python -m benchmarks.plain_loop", __doc__)
  parser.add_argument("--size", choices=sorted(llama.PRESETS), default="tiny")
  parser.add_argument("--optimizer", choices=sorted(optimizers.OPTIMIZERS), default="adamw")
  parser.add_argument("--windows", type=cli.at_least(1), default=3, help="timed windows")
  args = parser.parse_args(argv)
  jax.config.update("jax_num_cpu_devices", 8)  # The CPU backend only; GPUs and TPUs are as found.
  config = lm.get_config(f"size={args.size}")
  config.optax_name = args.optimizer
  loop = PlainLoop(config)
  seconds = median_step(loop.window_seconds(args.windows))
  print(f"{args.size} {args.optimizer}: {1 / seconds:.2f} steps/s, losses {loop.losses}")


if __name__ == "__main__":
  main()
