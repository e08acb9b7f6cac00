"""Shipped configs: `:arg` parsing, the keys every config has, and configs/lm_rules.py placing
params by rules alone."""

import flax.linen as nn
import jax
import pytest

import bv_sharding as bvs
from configs import lm, lm_rules
from configs.common import base_config, parse_arg
from trainers import build
from trainers.errors import ConfigError
from trainers.settings import validation


@pytest.mark.parametrize(
    "arg, expected",
    [
        ("flag=False", False),
        ("flag=false", False),
        ("flag=0", False),
        ("flag=True", True),
        ("flag=yes", True),
        ("", True),
    ],
)
def test_parse_arg_reads_bools(arg, expected):
  assert parse_arg(arg, flag=True, size="tiny")["flag"] is expected


def test_parse_arg_rejects_values_of_the_wrong_type():
  with pytest.raises(ConfigError, match="flag='maybe': expected True or False"):
    parse_arg("flag=maybe", flag=False)
  with pytest.raises(ConfigError, match="steps='ten': expected a int like 100"):
    parse_arg("steps=ten", steps=100)


def test_lm_rules_places_every_param_by_its_logical_names_as_flax_would():
  config = lm_rules.get_config()
  assert [chain for _, chain in config.sharding_strategy] == ["logical_partitioning()"]
  run = build.build(config, bvs.make_abstract_mesh(config.mesh, 8))
  plan, entries = run.plan, run.plan.by_name()
  boxes, _ = bvs.ops.flatten_with_names(jax.eval_shape(run.init))
  for name, box in boxes:
    expected = nn.logical_to_mesh_axes(box.names, config.sharding_rules)
    spec = entries[f"params/{name}"].spec
    assert tuple(spec) == tuple(expected) + (None,) * (len(spec) - len(expected)), name
  kernels = [e for e in plan.entries if e.name.startswith("params/") and len(e.shape) == 2]
  assert kernels and all(set(e.spec) == {"data", "model"} for e in kernels)
  assert plan.coverage > 0.99


def test_every_config_has_the_dtype_and_accumulation_keys_and_bad_values_fail_in_one_line():
  config = base_config()
  assert (config.compute_dtype, config.param_dtype, config.state_dtype) == (
      "float32",
      "float32",
      None,
  )
  assert config.grad_accum_steps == 1
  cases = [
      ("compute_dtype", "bf16", r"config.compute_dtype='bf16': must be one of \['float32', "),
      ("state_dtype", "half", "config.state_dtype='half': must be one of"),
      ("grad_accum_steps", 0, "config.grad_accum_steps=0: must be an integer >= 1"),
      ("grad_accum_steps", 5, "config.grad_accum_steps=5: must divide config.batch_size=32 .*=4"),
  ]
  for key, value, message in cases:
    config = lm.get_config()
    config[key] = value
    with pytest.raises(ConfigError, match=message):
      validation.check_config(config)
  config = lm.get_config()
  config.optax = dict(mu_dtype="float64")
  with pytest.raises(ConfigError, match=r"config.optax.mu_dtype='float64': must be one of"):
    validation.check_config(config)
