"""The run a config describes, built in one place: task, model, init, loss, optimizer, plan
and the compiled step.

:func:`build` turns a config and a mesh (a ``Mesh`` to train on, or an ``AbstractMesh``
to plan for devices that need not exist) into a frozen :class:`Run`; on a ``Mesh``,
:func:`compile_step` gives its :class:`Step`: the batch's sharding, the train step jitted
and compiled once ahead of time (with its memory figures) and the eval step. The trainer
(``trainers/train.py``), the planning command (``trainers/plan.py``), the sampler and
every benchmark build through it, so the command plans exactly what the trainer runs and a
benchmark measures the trainer's very step; one that measures another placement or
optimizer overrides the config (``config.sharding_strategy``, ``config.optax_name``)
before building.

The sequence: the token files' record (``records.resolve``) -> task -> one held-out
batch -> model and init -> the params' plan -> their layout -> the optimizer
(``trainers/optimizers/``, under ``config.on_nonfinite``) -> the plan of
``{"params", "opt"}``, which reuses the params' entries instead of planning them again;
then, on devices, the batch's sharding -> the jitted train and eval steps -> the train
step compiled from abstract inputs.

Example:
  >>> import bv_sharding as bvs
  >>> from configs import lm
  >>> config = lm.get_config()
  >>> run = build(config, bvs.make_abstract_mesh(config.mesh, 8))  # no arrays, no devices
  >>> run.example.shape  # one row of a batch: what init traces the model with
  (1, 128)
  >>> print(run.plan.by_name()["params/layers_0/attention/q_kernel"].why)
  '.*' -> llm_fsdp: dim 0 over data; gathered for compute: data
  >>> float(run.learning_rates["lr"](0))  # the warmup's first step
  0.0
"""

import dataclasses
import itertools
import warnings
from collections.abc import Callable
from typing import Any

import jax
import optax

import bv_sharding as bvs
from trainers import models, optimizers, steps
from trainers.figures import memory
from trainers.hooks import divergence
from trainers.input import batching, records, tasks
from trainers.models import axes
from trainers.settings import schema
from trainers.stored import StoredForm, stored_form


@dataclasses.dataclass(frozen=True)
class Run:
  """Everything a run of a config needs, built by :func:`build`.

  ``config`` is the typed config built from (:class:`trainers.settings.schema.Config`), its
  token files' record resolved (``records.resolve``);
  ``batch_shapes`` are the global batch's ``jax.ShapeDtypeStruct``s (of the first held-out
  batch: a train batch's too); ``init()`` returns the params (flax boxes kept), seeded by ``config.seed``;
  ``loss(params, batch)`` is the task's mean loss of the model; ``tx`` is the config's
  optimizer under its non-finite policy, for the params' ``layout``; ``learning_rates``
  are the schedules ``tx`` applies, for logging; ``plan`` is that of ``{"params", "opt"}``;
  ``migration`` says what becomes of optimizer state saved by another run
  (:class:`~trainers.optimizers.BuiltOptimizer`, asked by the checkpoints on restore);
  ``stored`` is the form the state is checkpointed in (:mod:`trainers.stored`: the same on any
  mesh).
  """

  config: Any
  task: tasks.Task
  batch_shapes: Any
  model: Any
  init: Callable[[], Any]
  loss: Callable[[Any, Any], Any]
  example: Any
  layout: optimizers.ParamLayout
  tx: optax.GradientTransformation
  learning_rates: dict[str, Callable]
  plan: bvs.Plan
  migration: optimizers.BuiltOptimizer
  stored: StoredForm

  @property
  def mesh(self):
    """The mesh the run is planned on (``Mesh`` or ``AbstractMesh``)."""
    return self.plan.mesh


def build(config, mesh) -> Run:
  """The :class:`Run` of ``config`` on ``mesh`` (``Mesh`` or ``AbstractMesh``); no arrays.

  The params are planned once: their plan gives the layout the optimizer follows (Kron
  and Shampoo fit each fixed tile of a param where its shards are, Muon orthogonalises each
  matrix on an owner device; ``bv_sharding/optimizers/layout.py`` and ``tiles.py``), and the
  state's plan reuses its entries.

  Example: ``build(config, bvs.make_mesh(config.mesh)).plan.report()``.
  """
  config = records.resolve(schema.of(config))  # vocab_size, dtype from the files' record.
  task = tasks.get_task(config)
  batch = next(held_out(task, config))
  shapes = batching.global_shapes(batch, config.batch_size)
  example = example_input(task, batch)
  model, init = model_and_init(config, example)
  strategy, rules = config.sharding_strategy, config.sharding_rules
  params_shapes = jax.eval_shape(init)
  unused = axes.unused_rules(rules, params_shapes)
  if unused:
    warnings.warn(
        f"config.sharding_rules names {unused}, which no param or activation of this model has "
        f"(so they shard nothing); check the spelling against the model's names",
        bvs.ShardingWarning,
        stacklevel=2,
    )
  params = bvs.plan({"params": params_shapes}, strategy, mesh, rules=rules)
  layout = optimizers.ParamLayout.from_plan(
      params, bvs.optimizers.layer_stacks(params_shapes, axes.LAYERS)
  )
  tx, learning_rates = optimizer(config, layout)
  # Complete: block stacks are where the optimizer runs them (their Stacks declare it).
  plan = bvs.plan(steps.abstract_state(init, tx), strategy, mesh, rules=rules, params=params)
  stored = stored_form(plan, layout, strategy, rules, params)
  abstract = stored.plan.abstract()  # As checkpoints hold it.
  migration = optimizers.BuiltOptimizer(
      config.optax_name,
      abstract["params"],
      layout,
      abstract["opt"],
      learning_rates.get("lr"),
      optimizers.state_decays(config.optax_name, config.optax or {}),
  )
  loss = loss_fn(task, model, plan)
  return Run(
      config,
      task,
      shapes,
      model,
      init,
      loss,
      example,
      layout,
      tx,
      learning_rates,
      plan,
      migration,
      stored,
  )


@dataclasses.dataclass(frozen=True)
class Step:
  """A run's steps on its mesh's devices, built by :func:`compile_step`.

  ``batch_sharding``: a global batch's (dim 0 over the data axes); ``jitted``: the train step
  ``step(state, batch) -> (state, metrics)`` (``steps.make_train_step``, over
  ``config.grad_accum_steps`` microbatches); ``train``: that step compiled once, ahead of
  time, for the planned state and the run's ``batch_shapes`` (it runs as ``jitted`` does,
  state donated, without compiling again); ``figures``: XLA's memory figures of it
  (:class:`memory.StepMemory`, None where the backend gives none); ``eval``: the jitted
  ``eval_step(params, batch) -> loss``.
  """

  batch_sharding: jax.sharding.NamedSharding
  jitted: Callable
  train: Any
  figures: memory.StepMemory | None
  eval: Callable


def jit_step(run: Run) -> tuple[jax.sharding.NamedSharding, Callable]:
  """The batch sharding of ``run`` and its jitted train step, not yet lowered: what
  :func:`compile_step` compiles, for a caller that times the lowering and compiling itself.

  Raises ``ConfigError`` if ``config.batch_size`` does not divide over the data axes.

  Example: ``sharding, jitted = jit_step(run); jitted.lower(run.plan.abstract(), batch)``.
  """
  config = run.config
  sharding = steps.checked_batch_sharding(config, run.mesh)
  return sharding, steps.make_train_step(
      run.loss, run.tx, run.plan, sharding, config.grad_accum_steps
  )


def compile_step(run: Run) -> Step:
  """The :class:`Step` of ``run`` (built on a ``Mesh``): what the trainer runs, the planning
  command's ``--compile`` sizes and every benchmark times; nothing allocated.

  Raises ``ConfigError`` if ``config.batch_size`` does not divide over the data axes.

  Example: ``step = compile_step(run); state, metrics = step.train(state, batch)``.
  """
  sharding, jitted = jit_step(run)
  compiled, figures = memory.compile_step(run.config, run.plan, jitted, sharding, run.batch_shapes)
  return Step(
      sharding, jitted, compiled, figures, steps.make_eval_step(run.loss, run.plan, sharding)
  )


def held_out(task, config):
  """The held-out batches (this process's rows), the same ones on every call: the first
  ``config.eval_batches`` are the run's evals.

  Example: ``list(itertools.islice(held_out(task, config), config.eval_batches))``.
  """
  return task.batches(task.held_out, global_batch=config.batch_size, seed=config.seed + 1)


def eval_batches(run: Run) -> list:
  """The ``config.eval_batches`` held-out batches every eval of ``run`` reads.

  Example: ``len(eval_batches(run)) == run.config.eval_batches``.
  """
  return list(itertools.islice(held_out(run.task, run.config), run.config.eval_batches))


def axis_types(config) -> str:
  """``config.mesh_axis_types``: how the trainer types its mesh's axes, for ``bvs.make_mesh``.

  ``"auto"`` (the default) lets XLA place what the plan does not pin; ``"explicit"`` makes
  every array's sharding part of its type: the loss gathers the params to their compute
  specs and the models lay out their activations (``trainers/models/axes.py``).

  Example:
    >>> from configs import lm
    >>> axis_types(lm.get_config())
    'auto'
  """
  return schema.of(config).mesh_axis_types


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


def loss_fn(task, model, plan: bvs.Plan | None = None) -> Callable[[Any, Any], Any]:
  """``loss(params, batch)``: ``task``'s loss of ``model`` applied to the batch's inputs.

  With ``plan``, the params are gathered to their compute specs where they are used
  (``bvs.gather_for_compute``: on a mesh with Explicit axes, the FSDP axes are gathered and
  the gradients come back in the storage specs; on an Auto mesh, nothing changes). A
  scanned stack of layers is gathered one layer at a time inside the scanned body (the
  model's ``gather_layer``), so only one layer's gathered params are live at once; the rest
  of the tree is gathered at the start of the loss.

  Example: ``steps.make_train_step(loss_fn(task, model, plan), tx, plan, batch_sharding)``.
  """
  gather, model = gathering(model, plan)

  def loss(params, batch):
    return task.loss(model.apply({"params": gather(params)}, task.inputs(batch)), batch)

  return loss


def gathering(model, plan: bvs.Plan | None) -> tuple[Callable[[Any], Any], Any]:
  """``(gather, model)``: ``gather(params)`` gathers what ``model`` reads outside a scanned
  stack, and ``model`` gathers each layer of its stack as the scanned body reads it.

  Example: ``gathering(model, None)`` leaves both as they are.
  """
  if plan is None:
    return lambda params: params, model
  stack = getattr(model, "STACK", None) if getattr(model, "scan_layers", False) else None
  if stack is None:
    return lambda params: bvs.gather_for_compute(params, plan), model
  at = f"params/{stack}"
  model = model.clone(gather_layer=lambda p: bvs.gather_for_compute(p, plan, stacked=at))

  def gather(params):
    rest = bvs.gather_for_compute({k: v for k, v in params.items() if k != stack}, plan)
    return {**rest, stack: params[stack]}

  return gather, model


def optimizer(config, layout=None) -> tuple[Any, dict[str, Callable]]:
  """``(tx, learning_rates)`` of the config's optimizer section, under its non-finite policy.

  big_vision's ``optax_name``/``optax``/``lr``/``wd``/``schedule``/``grad_clip_norm`` or a
  project optimizer (``trainers/optimizers/from_config.py``), wrapped by
  ``config.on_nonfinite`` (``trainers/hooks/divergence.py``); ``learning_rates`` are the very
  schedules it applies, for logging. :func:`build` calls it with the params' layout; a
  restore onto another layout calls it again with that one.

  Example: ``tx, lrs = optimizer(config); float(lrs["lr"](0))``.
  """
  config = schema.of(config)
  tx, learning_rates = optimizers.from_config(config, layout)
  return divergence.guard(tx, config.on_nonfinite), learning_rates
