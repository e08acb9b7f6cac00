"""Every optimizer of optax's own sharding tests in a user's loop on Explicit axes.

The loop has no trainer: params planned with ``bvs.plan``, the state planned by following
them (``jax.eval_shape(tx.init, params)`` under ``opt``), ``jax.jit(tx.init,
out_shardings=...)``, then a jitted step calling ``tx.update``, on ``jax.make_mesh``'s default
(Explicit) axes. Each optimizer is born sharded as planned, steps twice, and gives the updates
the same loop gives on Auto axes. Those whose update optax writes with ops Explicit axes
reject (a product over a sharded dim, ``svd`` of a sharded matrix) run through
``auto_axes_update``; which ones, and why, is recorded below, so a change in optax or in the
plan shows here.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType

import bv_sharding as bvs
from bv_sharding.optimizers import auto_axes_update

# optax's lists, as google-deepmind/optax has them: OPTIMIZERS of optax/_src/sharding_test.py
# (commit 02e43b47a58ce9584e0d27d23b0dae1d9a3bc567) and SHARDING_OPTIMIZERS of
# optax/contrib/_sharding_test.py (commit 476be990d8d3f7aa0243d638a95ec1d6ef4ebd9b), with
# their settings.
OPTAX_SHARDING_TESTS = {
    "adam": lambda: optax.adam(1.0),
    "sgd": lambda: optax.sgd(1.0),
    "adabelief": lambda: optax.adabelief(1.0),
    "adamax": lambda: optax.adamax(1.0),
    "adagrad": lambda: optax.adagrad(1.0),
    "adamw": lambda: optax.adamw(1.0),
    "rmsprop": lambda: optax.rmsprop(1.0),
    "lbfgs": lambda: optax.lbfgs(1.0, linesearch=None),
    "adadelta": lambda: optax.adadelta(1.0),
    "adafactor": lambda: optax.adafactor(),
    "adafactor2": lambda: optax.adafactor(min_dim_size_to_factor=1),
    "adan": lambda: optax.adan(1.0),
    "adamaxw": lambda: optax.adamaxw(1.0),
    "amsgrad": lambda: optax.amsgrad(1.0),
    "fromage": lambda: optax.fromage(1.0),
    "lamb": lambda: optax.lamb(1.0),
    "lars": lambda: optax.lars(1.0),
    "lion": lambda: optax.lion(1.0),
    "nadam": lambda: optax.nadam(1.0),
    "nadamw": lambda: optax.nadamw(1.0),
    "noisy_sgd": lambda: optax.noisy_sgd(1.0, key=0),  # optax's default key, given: no warning.
    "novograd": lambda: optax.novograd(1.0),
    "optimistic_gradient_descent": lambda: optax.optimistic_gradient_descent(1.0),
    "radam": lambda: optax.radam(1.0),
    "sm3": lambda: optax.sm3(1.0),
    "yogi": lambda: optax.yogi(1.0),
    "acprop": lambda: optax.contrib.acprop(1e-3),
    "ademamix": lambda: optax.contrib.ademamix(1e-3),
    "adopt": lambda: optax.contrib.adopt(1e-2),
    "cocob": lambda: optax.contrib.cocob(),
    "galore": lambda: optax.contrib.galore(1e-2, rank=4),
    "madgrad": lambda: optax.contrib.madgrad(1e-2),
    "muon": lambda: optax.contrib.muon(1e-2),
    "simplified_ademamix": lambda: optax.contrib.simplified_ademamix(1e-3),
    "dadapt_adamw": lambda: optax.contrib.dadapt_adamw(1e-1),
    "dog": lambda: optax.contrib.dog(1.0),
    "dowg": lambda: optax.contrib.dowg(1.0),
    "prodigy": lambda: optax.contrib.prodigy(1e-1),
    "schedule_free_adamw": lambda: optax.contrib.schedule_free_adamw(1e-2, warmup_steps=5000),
    "schedule_free_sgd": lambda: optax.contrib.schedule_free_sgd(1e-2, warmup_steps=5000),
}

# Updates Explicit axes reject, whatever the state's placement: what the error says.
NEEDS_AUTO_AXES = {
    "lbfgs": "Contracting dimensions are sharded",  # inner products of the whole tree
    "muon": "Contracting dimensions are sharded",  # Newton-Schulz products of a sharded matrix
    "dadapt_adamw": "Contracting dimensions are sharded",  # <grad, params - params_0>
    "prodigy": "Contracting dimensions are sharded",  # the same
    "galore": "svd must be unsharded",  # a projector from the sharded gradient's svd
}

# State leaves that come back from a step sharded otherwise than planned: a square param's
# row and column statistics have one shape, so neither is planned on the param's axis;
# the update computes the one that keeps the sharded dim sharded.
DRIFTS = {}  # adafactor2's square v_col drifted while following guessed its dim (issue 67)

SHAPES = {"matrix": (64, 32), "bias": (32,), "square": (32, 32), "cube": (16, 8, 4)}
STRATEGY = 'fsdp(axis="data", min_size_to_shard_mb=0)'
ABSTRACT = {n: jax.ShapeDtypeStruct(s, jnp.float32) for n, s in SHAPES.items()}


def _values(seed: int):
  rng = np.random.default_rng(seed)
  return {n: rng.standard_normal(s).astype(np.float32) for n, s in SHAPES.items()}


@functools.cache
def _mesh(axis_type):
  return jax.make_mesh((8,), ("data",), axis_types=(axis_type,))


def _step(tx):
  def step(params, opt, grads):
    updates, opt = tx.update(grads, opt, params)
    return optax.apply_updates(params, updates), opt, updates

  return jax.jit(step)


def _born(tx, mesh):
  """The user's plan and state: params put in the plan's shardings, ``tx.init`` jitted into
  the state's."""
  plan = bvs.plan({"params": ABSTRACT, "opt": jax.eval_shape(tx.init, ABSTRACT)}, STRATEGY, mesh)
  params = jax.device_put(_values(0), plan.shardings["params"])
  return plan, params, jax.jit(tx.init, out_shardings=plan.shardings["opt"])(params)


def _loop(tx, mesh):
  """Birth and two steps: the state's mismatches with the plan at birth and after the
  steps, and the steps' updates."""
  plan, params, opt = _born(tx, mesh)
  born, step, updates = plan.mismatches({"params": params, "opt": opt}), _step(tx), []
  for seed in (1, 2):
    params, opt, u = step(params, opt, jax.device_put(_values(seed), plan.shardings["params"]))
    updates.append(jax.device_get(u))
  return born, plan.mismatches({"params": params, "opt": opt}), updates


def _plain_error(tx, mesh) -> str:
  """What tracing ``tx``'s step, unwrapped, raises."""
  _, params, opt = _born(tx, mesh)
  with pytest.raises(Exception) as error:
    _step(tx).trace(params, opt, params)
  return str(error.value)


def test_the_list_is_optax_s_forty():
  assert len(OPTAX_SHARDING_TESTS) == 40
  assert set(NEEDS_AUTO_AXES) | set(DRIFTS) <= set(OPTAX_SHARDING_TESTS)


@pytest.mark.parametrize("name", OPTAX_SHARDING_TESTS)
def test_born_as_planned_steps_and_matches_auto_axes_on_explicit_axes(name):
  tx = OPTAX_SHARDING_TESTS[name]()
  _, _, expected = _loop(tx, _mesh(AxisType.Auto))
  if name in NEEDS_AUTO_AXES:
    assert NEEDS_AUTO_AXES[name] in _plain_error(tx, _mesh(AxisType.Explicit))
    tx = auto_axes_update(tx)
  born, stepped, updates = _loop(tx, _mesh(AxisType.Explicit))
  assert born == []
  assert stepped == DRIFTS.get(name, [])
  for want, got in zip(expected, updates):
    for key in SHAPES:
      np.testing.assert_allclose(got[key], want[key], atol=1e-5, rtol=1e-5, err_msg=key)


def test_factored_statistics_carry_only_the_axes_of_the_dims_they_keep():
  """Adafactor's statistics of a ``(16, 8, 4)`` param sharded on dim 0: the one keeping dims
  (1, 2) stays unsharded (on dim 0 of the statistic, "data" would meet the gradient's
  "data" on another dim of the product), the one keeping (0, 2) carries "data"; a square
  param's row statistic keeps its dim 0, the column one its dim 1 (optax's FactoredState
  says which: ``bv_sharding.optimizers.factored``); sm3's per-dim accumulators carry their dim's
  axis and no fallback's."""
  state = {
      "adafactor": jax.eval_shape(optax.adafactor(min_dim_size_to_factor=1).init, ABSTRACT),
      "sm3": jax.eval_shape(optax.sm3(1.0).init, ABSTRACT),
  }
  plan = bvs.plan({"params": ABSTRACT, "opt": state}, STRATEGY, _mesh(AxisType.Explicit))
  specs = {e.name: e.spec for e in plan.entries}
  assert specs["params/cube"] == jax.P("data", None, None)
  assert specs["opt/adafactor/0/v_row/cube"] == jax.P(None, None)
  assert specs["opt/adafactor/0/v_col/cube"] == jax.P("data", None)
  assert specs["params/square"] in (jax.P("data", None), jax.P(None, "data"))
  square = tuple(specs["params/square"])
  assert specs["opt/adafactor/0/v_row/square"] == jax.P(square[0])
  assert specs["opt/adafactor/0/v_col/square"] == jax.P(square[1])
  assert [specs[f"opt/sm3/0/mu/cube/{i}"] for i in range(3)] == [
      jax.P("data"),
      jax.P(None),
      jax.P(None),
  ]
