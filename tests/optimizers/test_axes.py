"""Every registry optimizer on a mesh with Explicit axes: the Auto update, in the plan's shardings.

One update of the tiny LM (one layer) with random gradients, on configs/lm.py's 1-D mesh and
configs/lm_tp_fsdp.py's 4x2 mesh, jitted as the trainer does: ``tx.init`` with the plan's
out_shardings, ``tx.update`` on params, grads and state in their planned shardings.
"""

import copy
import functools
import types

import flax.linen as nn
import jax
import numpy as np
import pytest

import bv_sharding as bvs
from benchmarks import traffic
from benchmarks.step_traffic import REMAT, captured_stderr
from bv_sharding.optimizers import SoapState
from configs import lm, lm_tp_fsdp
from tests.helpers import tiny_llama
from trainers import build, steps
from trainers.optimizers import OPTIMIZERS

CONFIGS = {"lm": lm, "lm_tp_fsdp": lm_tp_fsdp}


@functools.cache
def _config(name: str):
  return tiny_llama(CONFIGS[name].get_config)


@functools.cache
def _params(name: str, axis_types: str):
  """One build per config and kind of axes: ``(mesh, run, plan of the params, params)``."""
  config = _config(name)
  mesh = bvs.make_mesh(config.mesh, axis_types=axis_types)
  run = build.build(config, mesh)
  strategy, rules = config.sharding_strategy, config.sharding_rules
  params_plan = bvs.plan({"params": jax.eval_shape(run.init)}, strategy, mesh, rules=rules)
  with jax.set_mesh(mesh):
    params = jax.jit(lambda: nn.unbox(run.init()), out_shardings=run.plan.shardings["params"])()
  return mesh, run, params_plan, params


def _grads(params):
  leaves, treedef = jax.tree.flatten(params)
  rng = np.random.default_rng(0)
  grads = [rng.standard_normal(x.shape).astype(x.dtype) for x in leaves]
  return treedef.unflatten([jax.device_put(g, x.sharding) for g, x in zip(grads, leaves)])


@functools.cache
def _update(name: str, axis_types: str, optimizer: str, block_size: int | None = None, **optax):
  """One jitted update: its updates, the new state, the state's plan, HLO and compile log."""
  mesh, run, params_plan, params = _params(name, axis_types)
  config = copy.deepcopy(_config(name))
  config.optax_name = optimizer
  if block_size is not None:
    config.optax.block_size = block_size
  config.optax.update(optax)
  tx, _ = build.optimizer(config, run.layout)
  plan = bvs.plan(
      steps.abstract_state(run.init, tx),
      config.sharding_strategy,
      mesh,
      rules=config.sharding_rules,
      params=params_plan,
  )
  grads = _grads(params)
  with jax.set_mesh(mesh), captured_stderr() as log:
    opt = jax.jit(tx.init, out_shardings=plan.shardings["opt"])(params)
    compiled = jax.jit(tx.update).lower(grads, opt, params).compile()
    updates, new_opt = compiled(grads, opt, params)
  return types.SimpleNamespace(
      updates=jax.device_get(updates),
      state={"params": updates, "opt": new_opt},
      plan=plan,
      hlo=compiled.as_text(),
      log=log[0],
  )


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("config", CONFIGS)
def test_explicit_update_is_the_auto_update_in_the_plans_shardings(config, optimizer):
  explicit, auto = _update(config, "explicit", optimizer), _update(config, "auto", optimizer)
  # The updates in the params' shardings, the new state in the plan's.
  assert explicit.plan.mismatches(explicit.state) == []
  leaves = jax.tree_util.tree_leaves_with_path(explicit.updates)
  for (path, e), a in zip(leaves, jax.tree.leaves(auto.updates), strict=True):
    assert np.max(np.abs(e - a), initial=0.0) <= 1e-6, jax.tree_util.keystr(path)


def test_tiles_dealt_to_their_owners_under_explicit_axes():
  """Kron's 16-tiles on the 4x2 mesh: those spanning two 8-wide shards of "data" are dealt to
  their owners (collective permutes between the pair), the others gathered: the Auto update,
  in the plan's shardings."""
  explicit = _update("lm_tp_fsdp", "explicit", "kron", 16)
  auto = _update("lm_tp_fsdp", "auto", "kron", 16)
  assert explicit.plan.mismatches(explicit.state) == []
  for e, a in zip(jax.tree.leaves(explicit.updates), jax.tree.leaves(auto.updates), strict=True):
    assert np.max(np.abs(e - a), initial=0.0) <= 1e-6
  assert "collective-permute" in {c.op for c in traffic.collectives(explicit.hlo)}


def test_soap_pools_held_where_they_run_under_explicit_axes():
  """SOAP with every pool's state held where it runs (``resident_padding``) on the 4x2 mesh: the
  Auto update, its pools in the plan's shardings."""
  explicit = _update("lm_tp_fsdp", "explicit", "soap", resident_padding=64)
  auto = _update("lm_tp_fsdp", "auto", "soap", resident_padding=64)
  held = jax.tree.leaves(explicit.state["opt"], is_leaf=lambda x: isinstance(x, SoapState))
  assert [x.pools for x in held if isinstance(x, SoapState)][0]  # In the trainer's chain.
  assert explicit.plan.mismatches(explicit.state) == []
  for e, a in zip(jax.tree.leaves(explicit.updates), jax.tree.leaves(auto.updates), strict=True):
    assert np.max(np.abs(e - a), initial=0.0) <= 1e-6
  assert REMAT not in explicit.log


@pytest.mark.parametrize("optimizer", ["kron", "shampoo", "muon"])
def test_explicit_update_moves_the_auto_updates_bytes(optimizer):
  explicit = _update("lm_tp_fsdp", "explicit", optimizer)
  auto = _update("lm_tp_fsdp", "auto", optimizer)
  wire = traffic.wire_bytes(explicit.hlo), traffic.wire_bytes(auto.hlo)
  assert wire[1] > 0 and abs(wire[0] - wire[1]) <= 0.05 * wire[1], wire
  # No rematerialisation the Auto update does not do too (same partitioning).
  assert explicit.log.count(REMAT) == auto.log.count(REMAT)
