"""Model FLOPs from the compiled step, the peak FLOP/s table and MFU."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import bv_sharding as bvs
from trainers import utilization


def test_compiled_flops_count_the_whole_matmul_over_a_sharded_mesh():
  mesh = bvs.make_mesh([("data", -1)])
  rows = NamedSharding(mesh, P("data"))
  matmul = jax.jit(
      lambda x, w: x @ w, in_shardings=(rows, NamedSharding(mesh, P())), out_shardings=rows
  )
  compiled = matmul.lower(
      jax.ShapeDtypeStruct((64, 32), jnp.float32), jax.ShapeDtypeStruct((32, 16), jnp.float32)
  ).compile()
  flops, source = utilization.step_flops(compiled, jax.device_count(), formula=1.0)
  assert jax.device_count() == 8
  assert (flops, source) == (2 * 64 * 32 * 16, "compiled")


def test_a_scanned_step_counts_its_body_once_per_microbatch():
  """XLA's count of a ``lax.scan`` is its body's, once: scaled by the microbatches."""
  body = lambda total, x: (total + (x @ jnp.ones((32, 16))).sum(), None)
  scanned = jax.jit(lambda xs: jax.lax.scan(body, 0.0, xs)[0])
  counts = [
      utilization.step_flops(
          scanned.lower(jax.ShapeDtypeStruct((n, 64, 32), jnp.float32)).compile(), 1, 1.0, n
      )[0]
      for n in (1, 4)
  ]
  assert counts[1] == pytest.approx(4 * counts[0], rel=1e-3) and counts[0] >= 2 * 64 * 32 * 16


class _NoCount:
  """A compiled step whose backend counts nothing."""

  def __init__(self, analysis):
    self.analysis = analysis

  def cost_analysis(self):
    if isinstance(self.analysis, Exception):
      raise self.analysis
    return self.analysis


@pytest.mark.parametrize("analysis", [None, {}, {"flops": 0.0}, [], NotImplementedError()])
def test_without_a_count_the_formula_is_used_and_named(analysis):
  formula = utilization.formula_flops(100, tokens=8, layers=1, seq_len=4, d_model=2)
  assert formula == 8 * (6 * 100 + 12 * 4 * 2)
  assert utilization.step_flops(_NoCount(analysis), 8, formula) == (formula, "formula")


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
