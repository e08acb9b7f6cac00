"""The sharded pieces of a training loop, which the run builder (``trainers/build.py``) assembles.

The state is big_vision's ``{"params": ..., "opt": ...}``; one ``bvs.Plan`` over its
abstract shape gives the shardings of init, of the train step and of eval.

Example:
  >>> import flax.linen as nn
  >>> import jax
  >>> import optax
  >>> import bv_sharding as bvs
  >>> mesh = bvs.make_mesh([("data", -1)])  # the 8 simulated test devices
  >>> axes = data_axes(mesh, [("act_batch", "data")])
  >>> model, tx = nn.Dense(4), optax.adam(1e-2)
  >>> init = lambda: model.init(jax.random.key(0), jax.numpy.ones((1, 8)))["params"]
  >>> loss_fn = lambda params, x: ((model.apply({"params": params}, x) - 1) ** 2).mean()
  >>> plan = bvs.plan(abstract_state(init, tx), 'fsdp(axis="data", min_size_to_shard_mb=0)', mesh)
  >>> state = init_state(init, tx, plan)  # born sharded
  >>> plan.mismatches(state)
  []
  >>> train_step = make_train_step(loss_fn, tx, plan, batch_sharding(mesh, axes))
  >>> batch = jax.device_put(jax.numpy.ones((16, 8)), batch_sharding(mesh, axes))
  >>> state, first = train_step(state, batch)
  >>> state, second = train_step(state, batch)  # dispatched before anything of step 1 is read
  >>> sorted(second)
  ['l2_grads', 'l2_params', 'l2_updates', 'loss']
  >>> bool(second["loss"] < first["loss"]), float(make_eval_step(loss_fn, plan, batch_sharding(
  ...     mesh, axes))(state["params"], batch)) < float(first["loss"])
  (True, True)
"""

from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from bv_sharding import Plan, ShardingError
from bv_sharding.optimizers import compute_dtype
from trainers.errors import ConfigError
from trainers.input import batching
from trainers.models.axes import ACT_BATCH


def data_axes(mesh, rules: Sequence, axes: Sequence[str] = ()) -> tuple[str, ...]:
  """The mesh axes that split the batch: ``axes``, else those the "act_batch" rule maps to.

  Example:
    >>> from bv_sharding import make_abstract_mesh
    >>> mesh = make_abstract_mesh([("data", 4), ("fsdp", 2)], 8)
    >>> data_axes(mesh, [("act_batch", ("data", "fsdp"))])
    ('data', 'fsdp')
  """
  if not axes:
    axes = next((mapped for name, mapped in rules if name == ACT_BATCH), None)
  axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
  if not axes:
    raise ConfigError(
        f"config.data_axes is empty and config.sharding_rules has no "
        f'{ACT_BATCH!r} rule; set config.data_axes = ("data",) or add '
        f'("{ACT_BATCH}", "data") to config.sharding_rules'
    )
  unknown = [a for a in axes if a not in mesh.shape]
  if unknown:
    raise ConfigError(
        f"config.data_axes {axes} names {unknown}, which config.mesh does not "
        f"have; use axes of {list(mesh.shape)}"
    )
  return axes


def batch_sharding(mesh, axes: Sequence[str]) -> NamedSharding:
  """Dim 0 over ``axes``, the rest replicated (used in the module example)."""
  return NamedSharding(mesh, P(tuple(axes)))


def checked_batch_sharding(config, mesh) -> NamedSharding:
  """The batch's sharding over the config's data axes (:func:`data_axes`), once
  ``config.batch_size`` divides over them and the processes.

  Example: ``checked_batch_sharding(config, bvs.make_mesh(config.mesh)).spec == P(("data",))``.
  """
  axes = data_axes(mesh, config.sharding_rules, config.data_axes)
  batching.check_batch_size(config.batch_size, mesh, axes, jax.process_count())
  return batch_sharding(mesh, axes)


def abstract_state(init: Callable[[], Any], tx: optax.GradientTransformation) -> dict:
  """``{"params", "opt"}`` shapes without allocating; params keep their flax boxes.

  ``init()`` returns the params; the module example plans what this returns.
  """
  params = jax.eval_shape(init)
  return {"params": params, "opt": jax.eval_shape(tx.init, nn.unbox(params))}


def init_state(init: Callable[[], Any], tx: optax.GradientTransformation, plan: Plan) -> dict:
  """Params and optimizer state created directly in their planned shardings (module example)."""
  params = jax.jit(lambda: nn.unbox(init()), out_shardings=plan.shardings["params"])()
  return {"params": params, "opt": init_opt(tx, plan, params)}


def init_opt(tx: optax.GradientTransformation, plan: Plan, params) -> Any:
  """``tx.init(params)`` born in the plan's optimizer-state shardings (e.g. for restored params).

  Example: ``state = {"params": params, "opt": init_opt(tx, plan, params)}``.
  """
  return jax.jit(tx.init, out_shardings=plan.shardings["opt"])(params)


def check_state(plan: Plan, state, when: str) -> None:
  """Raises ``ShardingError`` if any array of ``state`` is not sharded as ``plan`` says.

  ``when`` (e.g. "after init") starts the message.
  """
  wrong = plan.mismatches(state)
  if wrong:
    raise ShardingError(
        f"{when}: {len(wrong)} arrays are not sharded as planned, e.g. " f"{wrong[:5]}"
    )


def make_train_step(
    loss_fn: Callable,
    tx: optax.GradientTransformation,
    plan: Plan,
    batch: NamedSharding,
    accum_steps: int = 1,
) -> Callable:
  """``step(state, batch) -> (state, metrics)``, jitted on the plan's shardings, state donated.

  ``loss_fn(params, batch)`` returns the mean loss; grads are constrained to the
  params' shardings before the optimizer sees them. ``accum_steps``
  (``config.grad_accum_steps``) splits the batch into that many microbatches
  (:func:`accumulate`). ``metrics`` are replicated float32 scalars left on the device
  (:func:`step_metrics`). See the module example.
  """
  shardings = plan.shardings
  loss_and_grads = accumulate(loss_fn, accum_steps, shardings["params"], batch)

  def step(state, batch):
    loss, grads = loss_and_grads(state["params"], batch)
    grads = constrain(grads, shardings["params"])
    updates, opt = tx.update(grads, state["opt"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    return {"params": params, "opt": opt}, step_metrics(loss, grads, params, updates)

  return jax.jit(
      step,
      in_shardings=(shardings, batch),
      out_shardings=(shardings, NamedSharding(plan.mesh, P())),
      donate_argnums=0,
  )


def step_metrics(loss, grads, params, updates) -> dict:
  """big_vision's step metrics: the loss and the L2 norms of grads, new params and updates.

  All float32 scalars (norms summed in float32 whatever the trees' dtypes).

  Example:
    >>> m = step_metrics(jnp.float32(2), {"w": jnp.ones(4)}, {"w": jnp.zeros(9)}, [jnp.ones(1)])
    >>> {k: float(v) for k, v in m.items()}
    {'loss': 2.0, 'l2_grads': 2.0, 'l2_params': 0.0, 'l2_updates': 1.0}
  """
  norm = lambda tree: optax.tree_utils.tree_norm(
      jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), tree)
  )
  return {
      "loss": jnp.asarray(loss, jnp.float32),
      "l2_grads": norm(grads),
      "l2_params": norm(params),
      "l2_updates": norm(updates),
  }


def compile_train_step(
    train_step: Callable, plan: Plan, batch_sharding: NamedSharding, batch_shapes: Any
) -> Any:
  """``train_step`` (:func:`make_train_step`'s) compiled for the plan's state and the batch.

  Nothing is allocated: the inputs are ``jax.ShapeDtypeStruct``s in the planned shardings
  (``plan.abstract()``) and, for the batch, ``batch_shapes`` (a tree of anything with the
  global batch's ``shape`` and ``dtype``) in ``batch_sharding``. The executable runs as
  ``train_step`` does (``compiled(state, batch)``, state donated) without compiling again,
  and its ``memory_analysis()`` gives the step's bytes per device before any array exists
  (``trainers/figures/memory.py``). Call it under the mesh and logical rules the loop runs under.

  Example:
    >>> import optax
    >>> from bv_sharding import make_mesh, plan as make_plan
    >>> mesh = make_mesh([("data", -1)])
    >>> tx = optax.sgd(0.1)
    >>> params = jax.ShapeDtypeStruct((8, 4), jnp.float32)
    >>> plan = make_plan({"params": params, "opt": jax.eval_shape(tx.init, params)},
    ...                  'fsdp(axis="data", min_size_to_shard_mb=0)', mesh)
    >>> loss_fn = lambda w, x: jnp.mean((x @ w) ** 2)
    >>> batch = batch_sharding(mesh, ("data",))
    >>> step = make_train_step(loss_fn, tx, plan, batch)
    >>> compiled = compile_train_step(step, plan, batch, jax.ShapeDtypeStruct((16, 8), jnp.float32))
    >>> compiled.memory_analysis().argument_size_in_bytes  # a device's row of w, 2 rows of x
    80
  """
  return train_step.lower(plan.abstract(), abstract_batch(batch_shapes, batch_sharding)).compile()


def abstract_batch(batch_shapes: Any, batch_sharding: NamedSharding) -> Any:
  """``batch_shapes`` (a tree of anything with a ``shape`` and ``dtype``) as
  ``jax.ShapeDtypeStruct``s in ``batch_sharding``: a batch to trace or compile with.

  Example:
    >>> from jax.sharding import AbstractMesh
    >>> sharding = NamedSharding(AbstractMesh((8,), ("data",)), P("data"))
    >>> abstract_batch({"tokens": jnp.zeros((16, 4))}, sharding)["tokens"].sharding.spec
    P('data',)
  """
  return jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=batch_sharding), batch_shapes
  )


def accumulate(
    loss_fn: Callable, accum_steps: int, param_shardings: Any, batch_sharding: NamedSharding
) -> Callable:
  """``(params, batch) -> (loss, grads)`` of ``loss_fn``, over ``accum_steps`` microbatches.

  Microbatch ``i`` holds rows ``i, i + accum_steps, ...``: each device splits its own rows
  of the batch (no data moves). A ``lax.scan`` sums each microbatch's loss and gradients
  (in float32, held in ``param_shardings``), so only one microbatch's activations are live
  at a time; the means over the microbatches are the loss and the gradients (in the
  params' dtype), those of the whole batch when ``loss_fn`` is a mean over equal rows.

  Example:
    >>> import jax.numpy as jnp
    >>> from jax.sharding import AbstractMesh
    >>> mesh = AbstractMesh((8,), ("data",))
    >>> loss_fn = lambda w, x: jnp.mean((x @ w) ** 2)
    >>> fn = accumulate(loss_fn, 4, None, NamedSharding(mesh, P("data")))
    >>> w, x = jnp.ones(3), jnp.arange(96.0).reshape(32, 3)
    >>> whole, split = jax.value_and_grad(loss_fn)(w, x), jax.jit(fn)(w, x)
    >>> bool(jnp.allclose(whole[0], split[0]) and jnp.allclose(whole[1], split[1]))
    True
  """
  loss_and_grads = jax.value_and_grad(loss_fn)
  if accum_steps == 1:
    return loss_and_grads
  to_params = lambda tree: tree if param_shardings is None else constrain(tree, param_shardings)

  def microbatches(x):
    rows = batch_sharding.shard_shape(x.shape)[0]
    if rows % accum_steps:
      raise ConfigError(
          f"config.grad_accum_steps={accum_steps}: each device holds {rows} rows of the "
          f"batch, which do not split into {accum_steps} microbatches; use a config.batch_size "
          f"that is a multiple of {accum_steps * x.shape[0] // rows}"
      )
    x = x.reshape(x.shape[0] // accum_steps, accum_steps, *x.shape[1:]).swapaxes(0, 1)
    return constrain(x, NamedSharding(batch_sharding.mesh, P(None, *batch_sharding.spec)))

  def loss_and_mean_grads(params, batch):
    def add(sums, microbatch):
      loss, grads = loss_and_grads(params, microbatch)
      summed = jax.tree.map(lambda s, g: s + g.astype(s.dtype), sums[1], to_params(grads))
      return (sums[0] + loss.astype(jnp.float32), to_params(summed)), None

    zeros = jax.tree.map(lambda p: jnp.zeros_like(p, compute_dtype(p.dtype)), params)
    start = (jnp.zeros((), jnp.float32), to_params(zeros))
    (total, summed), _ = jax.lax.scan(add, start, jax.tree.map(microbatches, batch))
    grads = jax.tree.map(lambda s, p: (s / accum_steps).astype(p.dtype), summed, params)
    return total / accum_steps, grads

  return loss_and_mean_grads


def constrain(tree, shardings):
  """``tree`` laid out in ``shardings`` (a matching tree of ``NamedSharding``s):
  ``jax.sharding.reshard`` on a mesh with Explicit axes (where ``with_sharding_constraint``
  only asserts), ``with_sharding_constraint`` on an Auto one.

  Example:
    >>> import bv_sharding as bvs
    >>> mesh = bvs.make_mesh([("data", -1)], axis_types="explicit")
    >>> with jax.set_mesh(mesh):
    ...   w = jax.jit(lambda: constrain(jnp.ones((8, 2)), NamedSharding(mesh, P("data"))))()
    >>> jax.typeof(w)
    ShapedArray(float32[8@data,2])
  """
  meshes = {s.mesh for s in jax.tree.leaves(shardings)}
  if any(m.explicit_axes for m in meshes):
    return jax.sharding.reshard(tree, shardings)
  return jax.lax.with_sharding_constraint(tree, shardings)


def make_eval_step(loss_fn: Callable, plan: Plan, batch: NamedSharding) -> Callable:
  """``eval_step(params, batch) -> loss``, jitted on the plan's param shardings (module example)."""
  return jax.jit(
      loss_fn,
      in_shardings=(plan.shardings["params"], batch),
      out_shardings=NamedSharding(plan.mesh, P()),
  )
