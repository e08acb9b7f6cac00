"""The model, init function, optimizer and sharding plan a config describes.

Built the same way for training (`trainers/train.py`) and for planning without
devices (`trainers/plan.py`), so the command plans exactly what the trainer runs.

Example:
  >>> example = example_input(task, batch)                   # one row of a batch
  >>> model, init = model_and_init(config, example)
  >>> tx = optimizer(config)
  >>> plan = plan_state(config, init, tx, bvs.make_abstract_mesh(config.mesh, 256))
"""

from collections.abc import Callable
from typing import Any

import jax

import bv_sharding as bvs
from trainers import models, optimizers, steps


def example_input(task, batch) -> Any:
  """The model input of the first row of `batch`: what init traces the model with.

  Example: `example_input(task, batch).shape == (1, config.seq_len)` for text.
  """
  return task.inputs(jax.tree.map(lambda x: x[:1], batch))


def model_and_init(config, example) -> tuple[Any, Callable[[], Any]]:
  """`(model, init)`: `init()` returns the params (flax boxes kept), seeded by `config.seed`.

  Example: `jax.eval_shape(model_and_init(config, example)[1])` allocates nothing.
  """
  model = models.get_model(config.model_name, **config.model.to_dict())
  return model, lambda: model.init(jax.random.key(config.seed), example)["params"]


def schedule(config) -> dict | None:
  """`config.schedule` with `total_steps` added, or None for a constant `config.lr`.

  Example: `optimizers.make_schedule(config.lr, **schedule(config))`.
  """
  if config.schedule is None:
    return None
  return {"total_steps": config.total_steps, **config.schedule.to_dict()}


def optimizer(config):
  """The optax transformation of `config.optax_name` / `config.optax`.

  Example: `optimizer(config).init(params)`.
  """
  try:
    return optimizers.make_optimizer(
        config.optax_name,
        config.lr,
        schedule=schedule(config),
        weight_decay=config.wd,
        clip_norm=config.grad_clip_norm,
        **config.optax.to_dict(),
    )
  except optimizers.OptimizerError as e:
    raise optimizers.OptimizerError(f"config.optax_name / config.optax: {e}") from None


def plan_state(config, init: Callable[[], Any], tx, mesh) -> bvs.Plan:
  """The plan of `{"params", "opt"}` on `mesh` (a `Mesh` or an `AbstractMesh`), nothing allocated.

  Example: `plan_state(config, init, tx, mesh).report()`.
  """
  return bvs.plan(
      steps.abstract_state(init, tx), config.sharding_strategy, mesh, rules=config.sharding_rules
  )
