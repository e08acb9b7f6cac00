"""How much of its hardware a run uses: model FLOPs per step, TFLOP/s per device and MFU.

MFU (model FLOPs utilization, PaLM appendix B) is the model FLOP/s a device achieves over its
dense bf16 peak. The FLOPs of a step are its matmul FLOPs as traced (``trainers/figures/flops.py``:
every scanned layer and microbatch counted): 3 x the forward pass's plus the optimizer's
update once (:func:`step_flops`), else the formula of :func:`formula_flops`;
``flops_source`` says which. Causal attention counts its full score and value matmuls, as
the traced model computes them.

Example:
  >>> peak_flops("NVIDIA H100 80GB HBM3"), peak_flops("TPU v5 lite"), peak_flops("cpu")
  (989000000000000.0, 197000000000000.0, None)
  >>> rates(2e12, steps_per_sec=10.0, tokens_per_step=4096, num_devices=2, peak=1e13)
  {'tokens_per_sec': 20480.0, 'tflops_per_device': 10.0, 'mfu': 1.0}
"""

import dataclasses
import math

import flax.linen as nn
import jax

from trainers import steps

# Dense (no sparsity) bf16 peak FLOP/s per chip, keyed by ``jax.Device.device_kind``; a kind
from trainers.figures import flops
from trainers.settings import schema

# matches the longest key it starts with (case-insensitive). Figures from the vendors' spec
# sheets: Google Cloud TPU system architecture pages (cloud.google.com/tpu/docs/v4, v5e, v5p,
# v6e), NVIDIA's A100, H100, H200, B200, L4 and L40S datasheets (Tensor Core BF16, without
# sparsity; the SXM part unless the name says PCIe or NVL).
PEAK_BF16_FLOPS = {
    "TPU v2": 45e12,
    "TPU v3": 123e12,
    "TPU v4": 275e12,
    "TPU v5 lite": 197e12,  # v5e
    "TPU v5e": 197e12,
    "TPU v5": 459e12,  # v5p
    "TPU v5p": 459e12,
    "TPU v6 lite": 918e12,  # v6e, Trillium
    "TPU v6e": 918e12,
    "NVIDIA A100": 312e12,  # SXM4 and PCIe alike
    "NVIDIA H100": 989e12,  # SXM5, e.g. "NVIDIA H100 80GB HBM3"
    "NVIDIA H100 PCIe": 756e12,
    "NVIDIA H100 NVL": 835e12,
    "NVIDIA GH200": 989e12,
    "NVIDIA H200": 989e12,  # SXM
    "NVIDIA H200 NVL": 835e12,
    "NVIDIA B200": 2250e12,
    "NVIDIA L4": 121e12,
    "NVIDIA L40S": 362e12,
}


def peak_flops(device_kind: str) -> float | None:
  """The dense bf16 peak FLOP/s of a ``device_kind``; None on CPU or for an unknown kind.

  The longest key of ``PEAK_BF16_FLOPS`` the kind starts with wins, so "TPU v5 lite" is a
  v5e, "TPU v5" a v5p, "NVIDIA H100 PCIe" not the SXM part.

  Example:
    >>> peak_flops("NVIDIA H100 PCIe"), peak_flops("TPU v5"), peak_flops("NVIDIA A100-SXM4-40GB")
    (756000000000000.0, 459000000000000.0, 312000000000000.0)
  """
  kind = device_kind.lower()
  known = [key for key in PEAK_BF16_FLOPS if kind.startswith(key.lower())]
  return PEAK_BF16_FLOPS[max(known, key=len)] if known else None


def formula_flops(
    num_params: int, tokens: int, layers: int = 0, seq_len: int = 0, d_model: int = 0
) -> float:
  """Training FLOPs of ``tokens`` tokens: ``6·N`` per token plus attention ``12·L·T·d``.

  The standard count of PaLM (Chowdhery et al. 2022, appendix B): forward and backward take
  ``6·N`` FLOPs per token for ``N`` params, and attention's score and value matmuls
  ``12·layers·seq_len·d_model`` more per token (leave them 0 for a model without attention
  over a sequence).

  Example:
    >>> formula_flops(1000, tokens=10), formula_flops(1000, tokens=10, layers=2, seq_len=4,
    ...     d_model=8)
    (60000.0, 67680.0)
  """
  return float(tokens * (6 * num_params + 12 * layers * seq_len * d_model))


def step_flops(loss, tx, state, batch, formula: float) -> tuple[float, str]:
  """(model FLOPs of one step over all devices, ``flops_source``): "jaxpr" or "formula".

  Traced, not compiled (``trainers/figures/flops.py``): 3 x the matmul FLOPs of ``loss(params,
  batch)`` over the whole global batch (the forward pass; the backward's two matmuls per
  forward one make the 3, and rematerialised forward passes are not counted) plus those of
  one ``tx.update(grads, opt, params)``. Every scanned layer counts, and the microbatches of
  ``config.grad_accum_steps`` too: they share the batch's rows, and a matmul's FLOPs are
  linear in them. ``state`` is ``{"params", "opt"}`` (arrays or ``ShapeDtypeStruct``s, e.g.
  ``plan.abstract()``; the grads are traced as the params), ``batch`` the global batch's
  (shardings kept). Where the loss holds no matmul a jaxpr shows (0, e.g. a custom kernel's),
  ``formula`` (:func:`formula_flops`) is returned with source "formula". Call it under the
  mesh and logical rules the step runs under.

  Example:
    >>> import jax, jax.numpy as jnp, optax
    >>> w, x = jnp.ones((8, 4)), jax.ShapeDtypeStruct((16, 8), jnp.float32)
    >>> loss = lambda w, x: jnp.mean(x @ w)
    >>> state = {"params": w, "opt": optax.sgd(0.1).init(w)}
    >>> step_flops(loss, optax.sgd(0.1), state, x, formula=1.0)  # 3 x 2*16*8*4, sgd: none
    (3072.0, 'jaxpr')
  """
  params = state["params"]
  forward = flops.traced_flops(loss, params, batch)
  if forward == 0:
    return float(formula), "formula"
  return 3 * forward + flops.traced_flops(tx.update, params, state["opt"], params), "jaxpr"


def run_formula_flops(run, config) -> float:
  """:func:`formula_flops` of a ``trainers.build.Run``'s step: ``N`` every param (the input
  embedding's too, which does no matmul), attention from the model's ``n_layers`` and
  ``d_model`` (Llama's; 0 for a model without them) and ``config.seq_len``.

  Example: ``run_formula_flops(build.build(config, mesh), config)``.
  """
  dims = getattr(run.model, "config", None)
  return formula_flops(
      sum(math.prod(e.shape) for e in run.plan.entries if e.name.startswith("params/")),
      config.batch_size * run.task.per_example,
      getattr(dims, "n_layers", 0),
      schema.of(config).seq_len or 0,
      getattr(dims, "d_model", 0),
  )


def step_cost(run, config, batch_sharding, batch_shapes) -> "StepCost":
  """The :class:`StepCost` of a run's train step: :func:`step_flops` of its loss and optimizer
  on its planned state and a global batch of ``batch_shapes`` in ``batch_sharding`` (traced
  under the run's mesh and ``config.sharding_rules``), this host's devices and their peak.

  ``run`` is a ``trainers.build.Run``; the fallback is :func:`run_formula_flops`.

  Example: ``step_cost(run, config, batch_sharding, shapes).flops``.
  """
  batch = steps.abstract_batch(batch_shapes, batch_sharding)
  formula = run_formula_flops(run, config)
  with jax.set_mesh(run.mesh), nn.logical_axis_rules(config.sharding_rules):
    total, source = step_flops(run.loss, run.tx, run.plan.abstract(), batch, formula)
  peak = peak_flops(jax.devices()[0].device_kind)
  return StepCost(total, source, jax.device_count(), peak)


def rates(
    flops_per_step: float,
    steps_per_sec: float,
    tokens_per_step: float,
    num_devices: int,
    peak: float | None,
    unit: str = "tokens",
) -> dict:
  """Per device: ``<unit>_per_sec``, ``tflops_per_device`` and ``mfu`` (None without ``peak``).

  ``tokens_per_step`` counts the global batch's ``unit`` (a task's tokens, or images);
  see the module example.
  """
  flops_per_sec = flops_per_step * steps_per_sec / num_devices
  return {
      f"{unit}_per_sec": tokens_per_step * steps_per_sec / num_devices,
      "tflops_per_device": flops_per_sec / 1e12,
      "mfu": flops_per_sec / peak if peak else None,
  }


@dataclasses.dataclass(frozen=True)
class StepCost:
  """A run's FLOPs per step (and where they come from), device count and peak FLOP/s per device.

  Example:
    >>> cost = StepCost(flops=8e12, source="jaxpr", num_devices=8, peak=None)
    >>> cost.record(steps_per_sec=2.0, per_step=1024, unit="tokens")["tflops_per_device"]
    2.0
  """

  flops: float
  source: str
  num_devices: int
  peak: float | None

  def record(self, steps_per_sec: float, per_step: float, unit: str) -> dict:
    """The metrics record's keys: ``flops_per_step``, ``flops_source`` and :func:`rates`."""
    speed = rates(self.flops, steps_per_sec, per_step, self.num_devices, self.peak, unit)
    return {"flops_per_step": self.flops, "flops_source": self.source, **speed}
