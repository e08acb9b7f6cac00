"""big_vision's optimizer section, unchanged: names, schedules, wd, clipping, against big_vision.

``tests/data/big_vision_optax.json`` was recorded by ``tools/record_big_vision.py``
from big_vision commit 0127fb6b337ee2a27bf4e54dea79cff176527356 (big_vision is not
on PyPI; none of its code is here): ``utils.create_learning_rate_schedule`` at
every step for several ``config.schedule`` dicts, and the params after each step
of big_vision's ``optax.make`` for a few optimizer sections on a small tree.
"""

import functools
import json

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

import bv_sharding as bvs
from configs import lm
from tests.helpers import ROOT, load_tool
from trainers.optimizers import OptimizerError, from_config, make_schedule

record = load_tool("record_big_vision")


@functools.cache
def recorded() -> dict:
  return json.loads((ROOT / "tests/data/big_vision_optax.json").read_text())


def section(total_steps=record.OPTIMIZER_TOTAL_STEPS, **values):
  return ml_collections.ConfigDict(dict(total_steps=total_steps, **values))


@pytest.mark.parametrize("name", sorted(record.SCHEDULES))
def test_schedules_match_big_vision_at_every_step(name):
  schedule, total, batch, data = record.SCHEDULES[name]
  fn = make_schedule(1.0, total, batch_size=batch, data_size=data, **schedule)
  ours = np.asarray(fn(jnp.arange(total + 1)))
  np.testing.assert_allclose(ours, recorded()["schedules"][name], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", sorted(record.OPTIMIZER_SECTIONS))
def test_optimizer_sections_update_params_as_big_vision(name):
  """Decoupled wd after the lr scaling on wd_mults' leaves, per-regex schedules, frozen
  leaves, lr_mults and clipping: params after each step equal big_vision's."""
  values = record.OPTIMIZER_SECTIONS[name]
  tx, _ = from_config(section(**values))
  # big_vision's own optimizers keep bfloat16 momentum, which the trainer updates in float32
  # (state_dtype.py) where big_vision rounds each step: equal to bfloat16's precision.
  rtol, atol = (2e-3, 2e-3) if values["optax_name"].startswith("big_vision.") else (2e-5, 2e-6)
  params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), record.small_params())
  state, update = tx.init(params), jax.jit(tx.update)
  for step, expected in enumerate(recorded()["optimizers"][name]):
    updates, state = update(record.small_grads(params, step), state, params)
    params = optax.apply_updates(params, updates)
    for leaf_name, value in expected.items():
      leaf = params
      for key in leaf_name.split("/"):
        leaf = leaf[key]
      np.testing.assert_allclose(leaf, value, rtol=rtol, atol=atol, err_msg=f"{name} {leaf_name}")


@pytest.mark.parametrize(
    "optax_name, optax_kwargs",
    [("identity", {}), ("optax.trace", dict(decay=0.0)), ("sgd", dict(momentum=0.0))],
)
def test_the_logged_learning_rate_is_the_one_the_optimizer_applies(optax_name, optax_kwargs):
  config = section(
      total_steps=20,
      optax_name=optax_name,
      optax=optax_kwargs,
      lr=0.5,
      wd=0.0,
      schedule=dict(decay_type="cosine", warmup_steps=4),
  )
  tx, learning_rates = from_config(config)
  params, grads = {"w": jnp.ones(3)}, {"w": jnp.full(3, 2.0)}
  state = tx.init(params)
  for step in range(8):
    updates, state = tx.update(grads, state, params)
    np.testing.assert_allclose(updates["w"], -2.0 * learning_rates["lr"](step), rtol=1e-6)
  assert float(learning_rates["lr"](4)) == pytest.approx(0.5)


def test_per_regex_schedules_are_each_logged():
  config = section(
      optax_name="scale_by_adam",
      lr=1.0,
      schedule=[("img/.*", None), ("a/.*", dict(decay_type="cosine")), (".*", {})],
  )
  _, learning_rates = from_config(config)
  assert set(learning_rates) == {"lr", "lr1"}
  assert float(learning_rates["lr"](record.OPTIMIZER_TOTAL_STEPS)) == pytest.approx(0.0)
  assert float(learning_rates["lr1"](5)) == pytest.approx(1.0)


def test_uncovered_params_and_project_names_with_regex_schedules_raise():
  tx, _ = from_config(section(optax_name="scale_by_adam", lr=1.0, schedule=[("a/.*", {})]))
  with pytest.raises(bvs.Error, match="'b/w' matches no regex of config.schedule"):
    tx.init({"a": {"w": jnp.ones(2)}, "b": {"w": jnp.ones(2)}})
  with pytest.raises(OptimizerError, match="takes one schedule.*scale_by_adam"):
    from_config(section(optax_name="adamw", lr=1.0, schedule=[("a/.*", {}), (".*", None)]))


@pytest.mark.parametrize(
    "values, fragments",
    [
        (dict(schedule=dict(decay="cosine")), ["schedule.decay was renamed", "decay_type"]),
        (dict(schedule=dict(end_value=1e-4)), ["schedule.end_value was renamed", "linear_end"]),
        (dict(schedule=dict(decay_typ="cosine")), ["did you mean 'decay_type'"]),
        (dict(schedule=dict(decay_type="exp")), ["decay_type='exp'", "cosine"]),
        (dict(schedule=dict(warmup_steps=1, warmup_percent=0.1)), ["keep only one"]),
        (dict(schedule=dict(warmup_epochs=1)), ["warmup_epochs needs", "warmup_steps"]),
        (dict(schedule=dict(warmup_steps=10)), ["must end before total_steps"]),
        (dict(optax_name="scale_by_adamm"), ["neither", "did you mean 'scale_by_adam'"]),
        (dict(optax_name="kronn"), ["project's optimizers", "did you mean 'kron'"]),
        (dict(optax_name="scale_by_adam", optax=dict(beta2=0.9)), ["Signature: scale_by_adam("]),
        (dict(lr_mults=[(".*", 0.0)]), ["config.lr_mults", "must be > 0"]),
        (dict(optax_name="big_vision.momentum_hpp"), ["library's", "'big_vision.momentum_hp'"]),
        (dict(schedule=None), ["config.schedule is None"]),
        (dict(optax_name="adamw", optax=dict(b1="abc")), ["b1='abc' is not a number", "0.9"]),
        (dict(optax=dict(b1="abc")), ["config.optax={'b1': 'abc'}", "b1='abc' is not a number"]),
        (dict(optax_name="adamw", optax=dict(b1=1.5)), ["b1=1.5 of optimizer 'adamw'", "[0, 1)"]),
        (dict(optax_name="shampoo", optax=dict(beta2=1)), ["beta2=1 of optimizer 'shampoo'"]),
    ],
)
def test_config_mistakes_name_the_key_and_the_fix(values, fragments):
  config = {**dict(optax_name="scale_by_adam", lr=1.0, schedule={}), **values}
  with pytest.raises(OptimizerError) as info:
    from_config(section(**config))
  for fragment in fragments:
    assert fragment in str(info.value), str(info.value)


def test_shipped_lm_config_accepts_big_vision_names_and_spelling():
  config = lm.get_config()
  for name in ("scale_by_adam", "adafactor", "kron"):
    with config.unlocked():
      config.optax_name = name
      config.schedule.decay_type = "cosine"
    tx, learning_rates = from_config(config)
    assert float(learning_rates["lr"](config.schedule.warmup_steps)) == pytest.approx(config.lr)
    assert isinstance(tx, optax.GradientTransformation)


def test_the_librarys_big_vision_names_follow_the_params_layout():
  # Shard-local blocks are cut from the layout: 2-row shards of a 16-row param on 8 devices
  # give a grid of 8 blocks down its rows, where the param without a layout gives 2.
  params = {"w": jax.ShapeDtypeStruct((16, 4), jnp.float32)}
  mesh = bvs.make_abstract_mesh([("data", 8)], 8)
  layout = bvs.optimizers.ParamLayout({"w": jax.P("data")}, mesh)
  config = section(
      optax_name="bv_sharding.scale_by_kron", lr=0.1, optax={"block_size": 8, "blocking": "local"}
  )
  stacks = lambda tx: [x.shape for x in jax.tree.leaves(jax.eval_shape(tx.init, params))]
  assert (8, 1, 2, 2) in stacks(from_config(config, layout)[0])
  assert (8, 1, 2, 2) not in stacks(from_config(config)[0])


def test_no_schedule_key_is_big_visions_constant_learning_rate():
  _, learning_rates = from_config(section(optax_name="scale_by_adam", lr=0.3))
  assert [float(learning_rates["lr"](s)) for s in (0, 9)] == pytest.approx([0.3, 0.3])
