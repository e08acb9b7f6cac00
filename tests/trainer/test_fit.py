"""trainers/fit.py and trainers/figures/memory.py: XLA's out-of-memory errors become one line of
ours, and what would fit is compiled to check.

XLA:CPU honours no memory limit, so the refusal cannot be forced here: the tests raise a real
``jax.errors.JaxRuntimeError`` carrying the message a TPU v5e gave, verbatim
(tests/data/xla_out_of_memory_tpu.json names its jax version and the step).
"""

import json

import jax
import pytest

import bv_sharding as bvs
from configs import lm
from tests.helpers import ROOT
from trainers import build, fit, steps
from trainers.errors import ConfigError
from trainers.figures import memory

GiB = 2**30
TPU = json.loads((ROOT / "tests/data/xla_out_of_memory_tpu.json").read_text())


@pytest.fixture(scope="module")
def run() -> build.Run:
  """The tiny LM at seq 64 on the 8 test devices (its step: 11.6 MiB a device)."""
  config = lm.get_config()
  config.seq_len = 64
  return build.build(config, bvs.make_mesh(config.mesh))


def test_the_tpu_refusal_becomes_one_line_with_xlas_figures_and_the_plans(run):
  with pytest.raises(ConfigError) as e:
    with memory.converted(run.plan, "compiling the train step"):
      raise jax.errors.JaxRuntimeError(TPU["message"])
  line = str(e.value)
  assert "\n" not in line and type(e.value) is ConfigError
  assert line.startswith(
      "config.batch_size / config.grad_accum_steps / config.model / config.mesh: compiling the "
      f"train step ran out of device memory (XLA: {TPU['message']}); the plan holds 723.1 KiB "
      "per device of params and optimizer state; largest leaves opt/1/0/mu/"
  )
  assert e.value.step.temporaries == round(78.75 * GiB)
  assert e.value.step.arguments == run.plan.bytes_per_device


def test_other_runtime_errors_pass_through(run):
  with pytest.raises(jax.errors.JaxRuntimeError, match="INTERNAL"):
    with memory.converted(run.plan, "the first step"):
      raise jax.errors.JaxRuntimeError("INTERNAL: something else")


def test_a_refused_step_gets_what_would_fit_compiled_in_order(run, monkeypatch):
  """XLA refuses the step (10.2 MiB of temporaries, by the TPU's message with the tiny step's
  figure) on devices of 8.2 MiB: 2 microbatches are compiled and fit; nothing after them is
  compiled."""
  compile_train_step, compiled = steps.compile_train_step, []

  def refuse_first(*args):
    compiled.append(args)
    if len(compiled) == 1:
      raise jax.errors.JaxRuntimeError(TPU["message"].replace("78.75G", "0.01G"))
    return compile_train_step(*args)

  monkeypatch.setattr(steps, "compile_train_step", refuse_first)
  logged = []
  with pytest.raises(ConfigError) as e:
    fit.checked_step(run, memory.budget([], memory_gib=0.008), log=logged.append)
  line = str(e.value)
  assert len(compiled) == 2 and "\n" not in line
  assert "ran out of device memory (XLA: RESOURCE_EXHAUSTED: Ran out of memory on HBM" in line
  assert "Would fit: --config.grad_accum_steps=2 (about " in line
  assert "of activations a microbatch; checked: 7.6 MiB per device, fits), or " in line
  assert (
      "--config.model.remat=True (recompute activations in the backward pass; not checked)" in line
  )
  assert line.endswith("(params, state and batch split further; not checked here)")
  assert logged == [
      "the train step does not fit: compiling 3 candidates on this host's devices to see what "
      "would (--config.grad_accum_steps=2, --config.model.remat=True, "
      "--config.state_dtype=bfloat16)"
  ]


def test_a_step_that_fits_is_returned_and_said(run):
  logged = []
  step = fit.checked_step(run, memory.budget([], memory_gib=1.0), log=logged.append)
  assert step.figures.total < 12 * 2**20
  assert logged[0].startswith("compiled train step: 11.6 MiB per device of 1.00 GiB")
