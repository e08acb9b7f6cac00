"""Shipped configs: `:arg` parsing, and configs/lm_rules.py placing params by rules alone."""

import flax.linen as nn
import jax
import pytest

import bv_sharding as bvs
from configs import lm_rules
from configs.common import parse_arg
from trainers import build
from trainers.errors import ConfigError


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
