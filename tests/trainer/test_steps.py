"""The train step built as the trainer builds it: gradient accumulation and mixed precision."""

import functools
import itertools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import bv_sharding as bvs
from configs import lm
from tests.helpers import tiny_llama
from trainers import build, steps
from trainers.errors import ConfigError
from trainers.input import batching, tasks

_lm = functools.partial(tiny_llama, lm.get_config)


def _runs(configs, count: int) -> list[tuple[list[float], int]]:
  """Per config: (the losses of ``count`` train steps, the compiled step's temp bytes).

  Built and run as trainers/train.py does; every run starts from one state, initialised
  once (the configs differ only in what the step does: accumulation, compute dtype).
  """
  config = configs[0]
  mesh = bvs.make_mesh(config.mesh)
  sharding = steps.batch_sharding(mesh, steps.data_axes(mesh, config.sharding_rules))
  task = tasks.get_task(config)
  batches = list(
      itertools.islice(task.batches(task.train, global_batch=config.batch_size, seed=0), count)
  )
  run = build.build(config, mesh)
  tx, plan = run.tx, run.plan
  runs = []
  with jax.set_mesh(mesh), nn.logical_axis_rules(config.sharding_rules):
    start = steps.init_state(run.init, tx, plan)
    for config in configs:
      model, _ = build.model_and_init(config, run.example)
      loss_fn = build.loss_fn(run.task, model)
      step = steps.make_train_step(loss_fn, tx, plan, sharding, config.grad_accum_steps)
      state = jax.tree.map(jnp.copy, start)  # The step donates it.
      global_batches = [batching.to_global(b, sharding) for b in batches]
      temp = step.lower(state, global_batches[0]).compile().memory_analysis().temp_size_in_bytes
      losses = []
      for batch in global_batches:
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
      runs.append((losses, temp))
  return runs


@pytest.mark.parametrize("optax_name", ["adamw", "kron"])
def test_accumulated_steps_train_as_the_whole_batch_in_less_memory(optax_name):
  counts = (1, 2, 4) if optax_name == "adamw" else (1, 4)
  # Kron's batches are 128 rows: at 32 its update's temporaries (2.2 MB a device, its pooled
  # tiles' work) outweigh the whole batch's activations, and both steps' peaks are the update's.
  keys = dict(optax_name=optax_name, batch_size=32 if optax_name == "adamw" else 128)
  runs = _runs([_lm(grad_accum_steps=k, **keys) for k in counts], 5)
  whole = runs[0][0]
  assert whole[-1] < whole[0]
  for losses, _ in runs[1:]:
    np.testing.assert_allclose(losses, whole, rtol=0, atol=1e-5)
  temps = [temp for _, temp in runs]  # adamw: 874, 433, 263 kB per device; kron: 3583, 2243.
  assert temps == sorted(temps, reverse=True) and temps[-1] < temps[0], temps


def test_bfloat16_compute_with_float32_params_trains_as_float32():
  # configs/lm.py's own tiny Llama (two layers, width 128), batches of 16 x 64 bytes.
  keys = dict(model=lm.get_config().model, batch_size=16, seq_len=64)
  runs = _runs([_lm(**keys), _lm(compute_dtype="bfloat16", **keys)], 50)
  (f32, _), (bf16, _) = runs
  assert np.mean(f32[-5:]) < f32[0] - 1.5  # Both learn ...
  # ... to the same loss: bfloat16's rounding moves the last 5 steps' mean by under 0.03.
  assert abs(np.mean(bf16[-5:]) - np.mean(f32[-5:])) < 0.03, (f32[-5:], bf16[-5:])


def test_microbatches_that_do_not_split_each_devices_rows_are_refused_by_name():
  mesh = jax.sharding.AbstractMesh((8,), ("data",))
  fn = steps.accumulate(lambda w, x: jnp.mean(x @ w), 2, None, steps.batch_sharding(mesh, ["data"]))
  shapes = jax.ShapeDtypeStruct((3,), jnp.float32), jax.ShapeDtypeStruct((8, 3), jnp.float32)
  with pytest.raises(ConfigError, match=r"grad_accum_steps=2: each device holds 1 rows .* of 16"):
    jax.eval_shape(fn, *shapes)
