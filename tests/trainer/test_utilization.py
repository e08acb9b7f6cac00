"""Model FLOPs of a step as traced, the peak FLOP/s table and MFU."""

import jax
import jax.numpy as jnp
import optax
import pytest

import bv_sharding as bvs
from configs import lm
from trainers import build, steps
from trainers.figures import utilization


def lm_cost(size: str, scan_layers: bool) -> tuple[float, str, float]:
  """(FLOPs per step, source, the 6·N·tokens + attention formula) of configs/lm.py's step."""
  config = lm.get_config(f"size={size}")
  config.model.update(scan_layers=scan_layers, remat=scan_layers)
  mesh = bvs.make_mesh(config.mesh, axis_types=build.axis_types(config))
  run = build.build(config, mesh)
  shapes = jax.ShapeDtypeStruct((config.batch_size, config.seq_len + 1), jnp.int32)
  cost = utilization.step_cost(run, config, steps.checked_batch_sharding(config, mesh), shapes)
  return cost.flops, cost.source, utilization.run_formula_flops(run, config)


@pytest.mark.parametrize("size", ["tiny", "small"])
def test_the_lm_step_counts_every_layer_scanned_or_not(size):
  """Scanned (and rematerialised) layers count as the unrolled ones do, and both as the
  6·N·tokens + attention formula within 10% (it counts the input embedding's params, which
  do no matmul)."""
  unrolled, source, formula = lm_cost(size, scan_layers=False)
  scanned, _, _ = lm_cost(size, scan_layers=True)
  assert source == "jaxpr"
  assert scanned == pytest.approx(unrolled, rel=0.02)
  assert unrolled == pytest.approx(formula, rel=0.1)


def test_the_optimizers_update_counts_once_beside_three_forward_passes():
  w, x = jnp.ones((8, 8)), jax.ShapeDtypeStruct((16, 8), jnp.float32)
  tx = optax.GradientTransformation(
      lambda params: optax.EmptyState(), lambda g, state, params=None: (g @ g @ g, state)
  )
  loss = lambda w, x: jnp.mean(jnp.tanh(x @ w))
  state = {"params": w, "opt": tx.init(w)}
  forward, update = 2 * 16 * 8 * 8, 2 * (2 * 8 * 8 * 8)
  assert utilization.step_flops(loss, tx, state, x, formula=1.0) == (
      3 * forward + update,
      "jaxpr",
  )


def test_without_a_matmul_the_formula_is_used_and_named():
  formula = utilization.formula_flops(100, tokens=8, layers=1, seq_len=4, d_model=2)
  assert formula == 8 * (6 * 100 + 12 * 4 * 2)
  loss = lambda w, x: jnp.mean(w * x)
  state = {"params": jnp.ones(4), "opt": optax.sgd(0.1).init(jnp.ones(4))}
  got = utilization.step_flops(loss, optax.sgd(0.1), state, jnp.ones((2, 4)), formula)
  assert got == (formula, "formula")


@pytest.mark.parametrize(
    "kind, peak",
    [
        ("TPU v4", 275e12),
        ("TPU v5 lite", 197e12),
        ("TPU v5", 459e12),
        ("TPU v5p", 459e12),
        ("TPU v6 lite", 918e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA A100 80GB PCIe", 312e12),
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H200", 989e12),
        ("NVIDIA H200 NVL", 835e12),
        ("NVIDIA B200", 2250e12),
        ("nvidia l4", 121e12),
        ("cpu", None),
        ("NVIDIA GeForce RTX 2080", None),
    ],
)
def test_peak_is_the_longest_matching_kind(kind, peak):
  assert utilization.peak_flops(kind) == peak


def test_peak_is_none_on_the_test_devices():
  assert utilization.peak_flops(jax.devices()[0].device_kind) is None


def test_rates_per_device_and_mfu():
  got = utilization.rates(4e12, 5.0, tokens_per_step=1000, num_devices=4, peak=10e12)
  assert got == pytest.approx({"tokens_per_sec": 1250.0, "tflops_per_device": 5.0, "mfu": 0.5})
  got = utilization.rates(4e12, 5.0, tokens_per_step=8, num_devices=4, peak=None, unit="images")
  assert got == {"images_per_sec": 10.0, "tflops_per_device": 5.0, "mfu": None}
