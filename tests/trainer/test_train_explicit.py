"""The trainer on a mesh with Explicit axes (``config.mesh_axis_types="explicit"``) trains as
on an Auto one: the same losses, step by step, from the same init and batches."""

import contextlib
import functools
import io
import itertools

import flax.linen as nn
import jax
import numpy as np
import pytest
from jax.ad_checkpoint import print_saved_residuals

import bv_sharding as bvs
from configs import lm, lm_tp_fsdp, vit_digits
from tests.helpers import tiny_llama
from trainers import build, steps
from trainers.input import batching

STEPS = 20


_tiny = functools.partial(tiny_llama, batch_size=16)


def _losses(config, axis_types: str, count: int) -> tuple[list[float], float]:
  """(``count`` train losses, the eval loss after them) of ``config`` on a mesh typed
  ``axis_types``, built and run as trainers/train.py does."""
  config.mesh_axis_types = axis_types
  mesh = bvs.make_mesh(config.mesh, axis_types=build.axis_types(config))
  sharding = steps.checked_batch_sharding(config, mesh)
  run = build.build(config, mesh)
  batches = run.task.batches(run.task.train, global_batch=config.batch_size, seed=0)
  with jax.set_mesh(mesh), nn.logical_axis_rules(config.sharding_rules):
    state = steps.init_state(run.init, run.tx, run.plan)
    step = steps.make_train_step(run.loss, run.tx, run.plan, sharding, config.grad_accum_steps)
    losses = []
    for batch in itertools.islice(batches, count):
      state, metrics = step(state, batching.to_global(batch, sharding))
      losses.append(float(metrics["loss"]))
    steps.check_state(run.plan, state, f"after {count} steps")  # Storage specs kept.
    eval_step = steps.make_eval_step(run.loss, run.plan, sharding)
    return losses, float(eval_step(state["params"], batching.to_global(batch, sharding)))


def _same_training(config, count: int = STEPS) -> list[float]:
  """The Explicit run's losses, once they match the Auto run's within 1e-4 (float32)."""
  auto, auto_eval = _losses(config.copy_and_resolve_references(), "auto", count)
  explicit, explicit_eval = _losses(config, "explicit", count)
  np.testing.assert_allclose(explicit, auto, rtol=0, atol=1e-4)
  np.testing.assert_allclose(explicit_eval, auto_eval, rtol=0, atol=1e-4)
  return explicit


def _scanned_tp(**keys):
  """configs/lm_tp_fsdp.py's tiny Llama: tensor parallel + FSDP, two layers scanned and
  rematerialised, two microbatches a step."""
  config = _tiny(lm_tp_fsdp.get_config, grad_accum_steps=2, **keys)
  config.model.update(n_layers=2, scan_layers=True, remat=True)
  return config


_lm = functools.partial(_tiny, lm.get_config)
_tp = functools.partial(_tiny, lm_tp_fsdp.get_config)
# configs/lm.py and configs/lm_tp_fsdp.py with the optimizers that lay out their own work
# (Kron's and Shampoo's blocks, Muon's owners), and adamw on the scanned, rematerialised,
# accumulating tp config.
CASES = [(_lm, name) for name in ("adamw", "kron", "shampoo", "muon")]
CASES += [(_tp, name) for name in ("kron", "shampoo", "muon")] + [(_scanned_tp, "adamw")]


@pytest.mark.parametrize(
    "make_config, optax_name",
    CASES,
    ids=[f"{'lm' if m is _lm else 'tp' if m is _tp else 'tp_scan'}-{n}" for m, n in CASES],
)
def test_explicit_axes_train_as_auto_ones(make_config, optax_name):
  losses = _same_training(make_config(optax_name=optax_name))
  assert losses[-1] < losses[0] - 0.5


def test_vit_on_explicit_axes():
  config = vit_digits.get_config()
  config.batch_size = 16
  assert _same_training(config, count=3)[-1] < 2.5


@pytest.mark.parametrize("remat", [False, True])
def test_scanned_stack_is_gathered_one_layer_at_a_time(remat):
  """On Explicit axes the scanned body gathers each layer's params where it reads them and
  the backward pass gathers them again: no gathered copy of the stack is saved from the
  forward pass, only the stored (sharded) stack itself."""
  config = _tiny(lm.get_config)
  config.model.update(n_layers=3, scan_layers=True, remat=remat)
  config.mesh_axis_types = "explicit"
  mesh = bvs.make_mesh(config.mesh, axis_types="explicit")
  sharding = steps.checked_batch_sharding(config, mesh)
  run = build.build(config, mesh)
  batch = next(run.task.batches(run.task.train, global_batch=config.batch_size, seed=0))
  saved = io.StringIO()
  with jax.set_mesh(mesh), nn.logical_axis_rules(config.sharding_rules):
    params = jax.jit(lambda: nn.unbox(run.init()), out_shardings=run.plan.shardings["params"])()
    with contextlib.redirect_stdout(saved):
      print_saved_residuals(run.loss, params, batching.to_global(batch, sharding))
  lines = saved.getvalue().splitlines()
  stored = [line for line in lines if "from the argument params['layers']" in line]
  assert stored and all("@data" in line for line in stored if "kernel" in line)  # As stored.
  gathers = [line.split()[0] for line in lines if "(gather_for_compute)" in line]
  shapes = lambda pick: {
      f"f32[{','.join(map(str, e.shape[1:] if pick else e.shape))}]"
      for e in run.plan.entries
      if e.name.startswith("params/") and e.name.startswith("params/layers/") == pick
  }
  assert gathers and not set(gathers) & (shapes(True) - shapes(False)), gathers
