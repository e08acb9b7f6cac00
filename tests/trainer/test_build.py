"""The run builder: one frozen record per (config, mesh), the params planned once, any mesh."""

import collections
import dataclasses
import re

import jax
import pytest
from jax.sharding import PartitionSpec as P

import bv_sharding as bvs
from bv_sharding import planning
from configs import lm
from trainers import build

REPLICATED = ((".*", "replicate()"),)


def tiny_lm(optax_name: str = "adamw"):
  """configs/lm.py's tiny Llama, short rows."""
  config = lm.get_config()
  config.seq_len, config.batch_size, config.optax_name = 16, 8, optax_name
  return config


def layout_specs(run: build.Run) -> list[P]:
  return jax.tree.leaves(run.layout.specs, is_leaf=lambda x: isinstance(x, P))


def test_run_is_a_frozen_record_of_what_the_trainer_needs():
  config = tiny_lm()
  run = build.build(config, bvs.make_abstract_mesh(config.mesh, 8))
  with pytest.raises(dataclasses.FrozenInstanceError):
    run.tx = None
  assert run.example.shape == (1, 16)
  assert set(run.plan.specs) == {"params", "opt"}
  assert run.layout.specs == run.plan.specs["params"] and run.layout.mesh is run.mesh
  assert float(run.learning_rates["lr"](config.schedule.warmup_steps)) == pytest.approx(config.lr)


def test_params_are_decided_once_and_the_state_plan_reuses_their_entries(monkeypatch):
  decided, plans = [], []
  decide, plan = planning._decide_param, bvs.plan
  monkeypatch.setattr(
      planning, "_decide_param", lambda leaf, pats: decided.append(leaf.name) or decide(leaf, pats)
  )
  monkeypatch.setattr(bvs, "plan", lambda *a, **k: plans.append(plan(*a, **k)) or plans[-1])
  config = tiny_lm("kron")
  run = build.build(config, bvs.make_abstract_mesh(config.mesh, 8))
  params = [e for e in run.plan.entries if e.name.startswith("params/")]
  assert sorted(decided) == sorted(e.name for e in params)  # each param once, in all
  # The state's plan is the run's, its block stacks placed where the optimizer stores them; the
  # state as checkpointed (Kron's pools given back, trainers/stored.py) has its own, on the same
  # params' entries.
  assert len(plans) == 3 and plans[1].treedef == run.plan.treedef
  assert run.stored.converts and plans[2] is run.stored.plan
  assert all(a is b for a, b in zip(plans[0].entries, params, strict=True))
  stored = [e for e in run.stored.plan.entries if e.name.startswith("params/")]
  assert all(a is b for a, b in zip(stored, params, strict=True))


def test_builds_on_an_abstract_mesh_larger_than_this_host():
  config = tiny_lm("shampoo")
  mesh = bvs.make_abstract_mesh(config.mesh, 64)  # 8 devices here
  run = build.build(config, mesh)
  assert run.mesh is mesh and run.plan.num_devices == 64
  assert run.layout.mesh is mesh
  assert max(e.nbytes // e.bytes_per_device for e in run.plan.entries) == 64


def test_a_replicated_strategy_replicates_the_layout_the_optimizer_blocks_by():
  config = tiny_lm("kron")
  mesh = bvs.make_abstract_mesh(config.mesh, 8)
  assert any(any(spec) for spec in layout_specs(build.build(config, mesh)))
  config.sharding_strategy = REPLICATED
  run = build.build(config, mesh)
  assert not any(any(spec) for spec in layout_specs(run))
  assert not any(e.sharded for e in run.plan.entries)


def test_a_rule_no_param_or_activation_names_is_a_warning():
  config = tiny_lm()
  config.sharding_rules = (("act_batch", "data"), ("layers", ()), ("mlpp", "data"))
  with pytest.warns(bvs.ShardingWarning, match=r"config.sharding_rules names \['mlpp'\], which no"):
    build.build(config, bvs.make_abstract_mesh(config.mesh, 8))


# A second-order optimizer's factor stacks of a scanned layer's param, by state path.
FACTORS = {
    "kron": r"Qs_preconditioners/layers/(.+)/\d+$",
    "shampoo": r"per_param/layers/(.+)/stats/\d+$",
    "soap": r"per_param/layers/(.+)/(?:stats|bases)/\d+$",
}


@pytest.mark.parametrize("optax_name", sorted(FACTORS))
def test_second_order_optimizers_precondition_each_scanned_layer_as_its_own_matrix(optax_name):
  """The scanned model's layer stacks reach the optimizers as stacks of layers (the layout's
  ``stacked``): each layer's ``(m, n)`` kernel gets a factor per dim (SOAP: a statistic and a
  basis), a norm scale its own (none under SOAP: 1-D params train with Adam), as unscanned, each
  stacked over the layers; no ``L x L`` factor mixes the layers."""
  config = tiny_lm(optax_name)
  config.model.scan_layers = True
  run = build.build(config, bvs.make_abstract_mesh(config.mesh, 8))
  stack = "params/layers/"
  params = {e.name.removeprefix(stack): e.shape for e in run.plan.entries if e.name.startswith(stack)}
  factors = collections.defaultdict(list)
  for e in run.stored.plan.entries:  # Each param's own (SOAP's pools given back to them).
    if found := re.search(FACTORS[optax_name], e.name):
      factors[found.group(1)].append(e.shape)
  assert params and factors
  for name, shape in params.items():
    dims = len(shape) - 1  # Each layer's.
    expected = (2 * dims if dims > 1 else 0) if optax_name == "soap" else dims
    assert len(factors[name]) == expected, (name, factors[name])
    assert all(s[0] == shape[0] for s in factors[name]), (name, factors[name])
