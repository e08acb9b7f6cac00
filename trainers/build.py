"""The model, init function, optimizer and sharding plan a config describes.

Built the same way for training (``trainers/train.py``) and for planning without
devices (``trainers/plan.py``), so the command plans exactly what the trainer runs.

Example:
  >>> import bv_sharding as bvs
  >>> from configs import lm
  >>> from trainers.input import tasks
  >>> config = lm.get_config()
  >>> task = tasks.get_task(config)
  >>> batch = next(task.batches(task.train, global_batch=config.batch_size, seed=0))
  >>> example = example_input(task, batch)  # one row of a batch
  >>> example.shape
  (1, 128)
  >>> model, init = model_and_init(config, example)
  >>> tx, learning_rates = optimizer(config)
  >>> plan = plan_state(config, init, tx, bvs.make_abstract_mesh(config.mesh, 8))  # no arrays
  >>> print(plan.by_name()["params/layers_0/attention/q_kernel"].why)
  '.*' -> llm_fsdp: dim 0 over data
"""

from collections.abc import Callable
from typing import Any

import jax

import bv_sharding as bvs
from trainers import divergence, models, optimizers, steps


def example_input(task, batch) -> Any:
  """The model input of the first row of ``batch``: what init traces the model with.

  Example: ``example_input(task, batch).shape == (1, config.seq_len)`` for text.
  """
  return task.inputs(jax.tree.map(lambda x: x[:1], batch))


def model_and_init(config, example) -> tuple[Any, Callable[[], Any]]:
  """``(model, init)``: ``init()`` returns the params (flax boxes kept), seeded by ``config.seed``.

  Example: ``jax.eval_shape(model_and_init(config, example)[1])`` allocates nothing.
  """
  model = models.from_config(config)
  return model, lambda: model.init(jax.random.key(config.seed), example)["params"]


def loss_fn(task, model) -> Callable[[Any, Any], Any]:
  """``loss(params, batch)``: ``task``'s loss of ``model`` applied to the batch's inputs.

  Example: ``steps.make_train_step(loss_fn(task, model), tx, plan, batch_sharding)``.
  """
  return lambda params, batch: task.loss(model.apply({"params": params}, task.inputs(batch)), batch)


def param_layout(config, init: Callable[[], Any], mesh) -> optimizers.ParamLayout:
  """The params' layout on ``mesh``, planned alone first: Kron, Shampoo and Muon cut their
  blocks inside each device's shard (``trainers/optimizers/layout.py``).

  Example: ``optimizer(config, param_layout(config, init, mesh))``.
  """
  params = bvs.plan(
      {"params": jax.eval_shape(init)}, config.sharding_strategy, mesh, rules=config.sharding_rules
  )
  return optimizers.ParamLayout.from_plan(params)


def optimizer(config, layout=None) -> tuple[Any, dict[str, Callable]]:
  """``(tx, learning_rates)`` of the config's optimizer section, under its non-finite policy.

  big_vision's ``optax_name``/``optax``/``lr``/``wd``/``schedule``/``grad_clip_norm`` or a
  project optimizer (``trainers/optimizers/from_config.py``), wrapped by
  ``config.on_nonfinite`` (``trainers/divergence.py``); ``learning_rates`` are the very
  schedules it applies, for logging.

  Example: ``tx, lrs = optimizer(config); float(lrs["lr"](0))``.
  """
  tx, learning_rates = optimizers.from_config(config, layout)
  return divergence.guard(tx, config.get("on_nonfinite", "stop")), learning_rates


def plan_state(config, init: Callable[[], Any], tx, mesh) -> bvs.Plan:
  """The plan of ``{"params", "opt"}`` on ``mesh`` (``Mesh`` or ``AbstractMesh``); no arrays.

  Example: ``plan_state(config, init, tx, mesh).report()``.
  """
  return bvs.plan(
      steps.abstract_state(init, tx), config.sharding_strategy, mesh, rules=config.sharding_rules
  )
