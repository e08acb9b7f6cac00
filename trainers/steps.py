"""The sharded pieces of a training loop, shared by trainers/train.py and benchmarks/throughput.py.

The state is big_vision's `{"params": ..., "opt": ...}`; one `bvs.Plan` over its
abstract shape gives the shardings of init, of the train step and of eval.

Example:
  >>> axes = data_axes(mesh, config.sharding_rules, config.data_axes)   # ("data",)
  >>> check_batch_size(config.batch_size, mesh, axes, jax.process_count())
  >>> plan = bvs.plan(abstract_state(init, tx), config.sharding_strategy, mesh)
  >>> state = init_state(init, tx, plan)                               # born sharded
  >>> train_step = make_train_step(loss_fn, tx, plan, batch_sharding(mesh, axes))
  >>> state, loss = train_step(state, batch)
"""

import math
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from bv_sharding import Plan, ShardingError
from trainers.errors import ConfigError

BATCH_RULE = "act_batch"


def data_axes(mesh, rules: Sequence, axes: Sequence[str] = ()) -> tuple[str, ...]:
  """The mesh axes that split the batch: `axes`, else those the "act_batch" rule maps to.

  Example: `data_axes(mesh, [("act_batch", ("data", "fsdp"))])` == ("data", "fsdp").
  """
  if not axes:
    axes = next((mapped for name, mapped in rules if name == BATCH_RULE), None)
  axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
  if not axes:
    raise ConfigError(
        f"config.data_axes is empty and config.sharding_rules has no "
        f'{BATCH_RULE!r} rule; set config.data_axes = ("data",) or add '
        f'("{BATCH_RULE}", "data") to config.sharding_rules'
    )
  unknown = [a for a in axes if a not in mesh.shape]
  if unknown:
    raise ConfigError(
        f"config.data_axes {axes} names {unknown}, which config.mesh does not "
        f"have; use axes of {list(mesh.shape)}"
    )
  return axes


def check_batch_size(batch_size: int, mesh, axes: Sequence[str], process_count: int) -> None:
  """Raises unless `batch_size` splits evenly over the data axes and the processes.

  Example: `check_batch_size(30, mesh, ("data",), 1)` raises on 8 data devices.
  """
  shards = math.prod(mesh.shape[a] for a in axes)
  need = math.lcm(shards, process_count)
  if batch_size <= 0 or batch_size % need:
    raise ConfigError(
        f"config.batch_size={batch_size} must be a positive multiple of {need}: the data axes "
        f"{tuple(axes)} span {shards} devices and there are {process_count} processes; use "
        f"e.g. --config.batch_size={max(need, batch_size // need * need)}"
    )


def batch_sharding(mesh, axes: Sequence[str]) -> NamedSharding:
  """Dim 0 over `axes`, the rest replicated.

  Example: `batch_sharding(mesh, ("data",))` == NamedSharding(mesh, P(("data",))).
  """
  return NamedSharding(mesh, P(tuple(axes)))


def abstract_state(init: Callable[[], Any], tx: optax.GradientTransformation) -> dict:
  """`{"params", "opt"}` shapes without allocating; params keep their flax boxes.

  Example: `bvs.plan(abstract_state(init, tx), 'fsdp(axis="data")', mesh)`.
  """
  params = jax.eval_shape(init)
  return {"params": params, "opt": jax.eval_shape(tx.init, nn.unbox(params))}


def init_state(init: Callable[[], Any], tx: optax.GradientTransformation, plan: Plan) -> dict:
  """Params and optimizer state created directly in their planned shardings.

  Example: `plan.mismatches(init_state(init, tx, plan)) == []`.
  """
  params = jax.jit(lambda: nn.unbox(init()), out_shardings=plan.shardings["params"])()
  return {"params": params, "opt": init_opt(tx, plan, params)}


def init_opt(tx: optax.GradientTransformation, plan: Plan, params) -> Any:
  """``tx.init(params)`` born in the plan's optimizer-state shardings (e.g. for restored params).

  Example: `state = {"params": params, "opt": init_opt(tx, plan, params)}`.
  """
  return jax.jit(tx.init, out_shardings=plan.shardings["opt"])(params)


def check_state(plan: Plan, state, when: str) -> None:
  """Raises if any array of `state` is not sharded as `plan` says.

  Example: `check_state(plan, state, "after init")`.
  """
  wrong = plan.mismatches(state)
  if wrong:
    raise ShardingError(
        f"{when}: {len(wrong)} arrays are not sharded as planned, e.g. " f"{wrong[:5]}"
    )


def make_train_step(
    loss_fn: Callable, tx: optax.GradientTransformation, plan: Plan, batch: NamedSharding
) -> Callable:
  """`step(state, batch) -> (state, loss)`, jitted on the plan's shardings, state donated.

  `loss_fn(params, batch)` returns the mean loss; grads are constrained to the
  params' shardings before the optimizer sees them.

  Example: `state, loss = make_train_step(loss_fn, tx, plan, sharding)(state, batch)`.
  """
  shardings = plan.shardings

  def step(state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(state["params"], batch)
    grads = jax.lax.with_sharding_constraint(grads, shardings["params"])
    updates, opt = tx.update(grads, state["opt"], state["params"])
    return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, loss

  return jax.jit(
      step,
      in_shardings=(shardings, batch),
      out_shardings=(shardings, NamedSharding(plan.mesh, P())),
      donate_argnums=0,
  )


def make_eval_step(loss_fn: Callable, plan: Plan, batch: NamedSharding) -> Callable:
  """`eval_step(params, batch) -> loss`, jitted on the plan's param shardings.

  Example: `float(make_eval_step(loss_fn, plan, sharding)(state["params"], batch))`.
  """
  return jax.jit(
      loss_fn,
      in_shardings=(plan.shardings["params"], batch),
      out_shardings=NamedSharding(plan.mesh, P()),
  )
