"""trainers/settings/validation.py: bad input never costs a run, one error of ours before anything is written.

Most cases call the trainer's own checks in-process (cheap); real ``python -m trainers.train``
runs show the same through the entry point: one line naming the key, exit status 1, nothing
allocated, the workdir byte-identical (``trainers.launch``, ``trainers.plan`` and
``trainers.convert``: tests/e2e/test_<command>.py).
"""

import math
import random
import re

import pytest

import configs.lm
import configs.vit_digits
from tests.helpers import COMPILED_LM, assert_untouched, train, used_workdir
from trainers.errors import ConfigError
from trainers.figures import memory
from trainers.settings import validation

GiB = 2**30


def lm_config(**overrides) -> dict:
  config = configs.lm.get_config().to_dict()
  for key, value in overrides.items():
    *parents, last = key.split(".")
    node = config
    for parent in parents:
      node = node[parent]
    node[last] = value
  return config


def assert_one_error(config, key, **process):
  with pytest.raises(ConfigError) as e:
    validation.check_config(config, **process)
  assert key in str(e.value) and "e.g." in str(e.value), str(e.value)
  assert "\n" not in str(e.value)


# Every numeric key the trainer reads, with what a valid value is.
INT_KEYS = {
    "total_steps": 1,
    "batch_size": 1,
    "eval_batches": 1,
    "log_every": 1,
    "eval_every": 1,
    "seq_len": 1,
    "seed": 0,
    "schedule.warmup_steps": 0,
}
FLOAT_KEYS = {
    "lr": True,
    "grad_clip_norm": True,
    "wd": False,
    "schedule.linear_end": False,
    "device_memory_gib": True,
}
NONE_OK = ("grad_clip_norm", "device_memory_gib")  # None: no clipping / ask the devices.


def bad_values(rng: random.Random, minimum=None, positive=None):
  """Random values that must be rejected: below the bound, non-finite, or of the wrong type."""
  wrong_type = [True, False, "1", "0.1", [1], {"a": 1}, b"1"]
  if minimum is not None:
    below = [minimum - 1 - rng.randrange(10**6), -(2**63) - rng.randrange(5)]
    return below + [rng.uniform(-1e6, 1e6) + 0.5, math.nan, math.inf, None] + wrong_type
  below = [-rng.expovariate(1e-3), -rng.random() * 1e-9, -math.inf] + ([0, 0.0] if positive else [])
  return below + [math.nan, math.inf] + wrong_type + ([None] if positive else [])


@pytest.mark.parametrize("key, minimum", INT_KEYS.items())
def test_fuzz_integer_keys(key, minimum):
  rng = random.Random(f"bad-{key}")
  for _ in range(8):
    for value in bad_values(rng, minimum=minimum):
      assert_one_error(lm_config(**{key: value}), f"config.{key}={value!r}")


@pytest.mark.parametrize("key, positive", FLOAT_KEYS.items())
def test_fuzz_number_keys(key, positive):
  rng = random.Random(f"bad-{key}")
  for _ in range(8):
    for value in bad_values(rng, positive=positive):
      if key in NONE_OK and value is None:
        continue
      assert_one_error(lm_config(**{key: value}), f"config.{key}=")


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"lr": math.nan}, "config.lr=nan: must be a finite number > 0"),
        ({"lr": -3e-3}, "config.lr=-0.003: must be a finite number > 0"),
        ({"seq_len": 0}, "config.seq_len=0: must be an integer >= 1"),
        ({"grad_clip_norm": -1.0}, "config.grad_clip_norm=-1.0: must be a finite number > 0"),
        (
            {"schedule.warmup_steps": -10},
            "config.schedule.warmup_steps=-10: must be an integer >= 0",
        ),
        ({"total_steps": 0}, "config.total_steps=0: must be an integer >= 1"),
        ({"total_steps": -5}, "config.total_steps=-5: must be an integer >= 1"),
        ({"eval_every": 0}, "config.eval_every=0: must be an integer >= 1"),
        ({"log_every": 0}, "config.log_every=0: must be an integer >= 1"),
        ({"eval_batches": 0}, "config.eval_batches=0: must be an integer >= 1"),
        ({"seed": -1}, "config.seed=-1: must be an integer >= 0"),
        ({"rewarmup_steps": -1}, "config.rewarmup_steps=-1: must be an integer >= 0"),
        ({"sharding_rules": (("act_batch",),)}, "config.sharding_rules=(('act_batch',),)"),
    ],
)
def test_survey_worst_cases(overrides, message):
  """The issue's list, one by one: each was accepted silently or crashed after allocating."""
  with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
    validation.check_config(lm_config(**overrides), devices_per_process=8)


def test_valid_configs_and_boundaries_pass():
  for config in (configs.lm.get_config(), configs.vit_digits.get_config()):
    validation.check_config(config, devices_per_process=8)
  edge = dict(seed=0, total_steps=1, log_every=1, eval_every=1, eval_batches=1, seq_len=1)
  validation.check_config(lm_config(**edge, grad_clip_norm=None, wd=0, schedule=None))
  validation.check_config(lm_config(**{"schedule.warmup_steps": 0, "schedule.linear_end": 0}))
  validation.check_config(lm_config(profile_steps=(1, 2)))


@pytest.mark.parametrize(
    "overrides, key",
    [
        ({"data_axes": ("data", "data")}, "config.data_axes"),
        ({"data_axes": ("data", "")}, "config.data_axes"),
        ({"sharding_rules": (("act_batch",),)}, "config.sharding_rules"),  # One-element rule.
        ({"sharding_rules": ("act_batch",)}, "config.sharding_rules"),
        ({"sharding_strategy": ((".*",),)}, "config.sharding_strategy"),
        ({"sharding_strategy": {".*": "fsdp(axis='data')"}}, "config.sharding_strategy"),
        ({"mesh": ("data", -1)}, "config.mesh"),
        ({"on_nonfinite": "stopp"}, "config.on_nonfinite"),
        ({"mesh_axis_types": "explict"}, "config.mesh_axis_types"),
        ({"schedule.decay_type": "cosin"}, "config.schedule.decay_type"),
        ({"schedule": {"warmup": 10}}, "config.schedule.warmup"),
        ({"schedule": 3}, "config.schedule"),
        ({"optax": 0.9}, "config.optax"),
        ({"profile_steps": (3, 3)}, "config.profile_steps"),
        ({"profile_steps": (0, 2)}, "config.profile_steps"),
        ({"profile_steps": (2,)}, "config.profile_steps"),
        ({"profile_steps": (2.0, 4)}, "config.profile_steps"),
        ({"profile_steps": (500, 503)}, "starts after config.total_steps="),
    ],
)
def test_structured_keys(overrides, key):
  with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
    validation.check_config(lm_config(**overrides))


@pytest.mark.parametrize(
    "process, key",
    [
        ({"devices_per_process": 0}, "--devices_per_process=0"),
        ({"devices_per_process": -1}, "--devices_per_process=-1"),
        ({"num_processes": 0}, "--num_processes=0"),
        ({"num_processes": 2, "process_id": 2}, "--process_id=2"),
        ({"process_id": -1}, "--process_id=-1"),
    ],
)
def test_process_flags(process, key):
  with pytest.raises(ConfigError, match=key):
    validation.check_config(configs.lm.get_config(), **process)


def test_train_rejects_a_bad_value_before_touching_the_workdir(tmp_path):
  """The survey's worst case: a run failing validation truncated the earlier metrics."""
  workdir = used_workdir(tmp_path / "run")
  status, out, _ = train(workdir, "--config.lr=-0.1", timeout=120)
  assert status == 1 and "ConfigError: config.lr=-0.1: must be a finite number > 0" in out, out
  assert "Traceback" not in out and "initialising params" not in out
  assert_untouched(workdir)


def test_plan_that_cannot_fit_fails_before_init(tmp_path):
  """configs/lm_7b_pod.py on 8 CPU devices: 10 GiB per device, stopped before allocation."""
  workdir = used_workdir(tmp_path / "run")
  status, out, _ = train(workdir, config="configs/lm_7b_pod.py", timeout=120)
  assert status == 1, out[-3000:]
  line = next(x for x in out.splitlines() if x.startswith("ConfigError:"))
  assert "the plan needs" in line and "host's available memory (8 CPU devices)" in line
  assert "largest leaves per device: opt/" in line and "config.model" in line
  assert "initialising params" not in out
  assert_untouched(workdir)


def test_compiled_step_that_cannot_fit_fails_before_init(tmp_path):
  """The tiny LM's params, state and gradients (966 KiB per device) fit 8.2 MiB; its compiled
  step (11.5 MiB: a 32 x 64 token batch's activations) does not, and the run stops before
  anything is allocated or written, naming the figures and what would fit, compiled to check
  (2 microbatches: 7.6 MiB)."""
  workdir = used_workdir(tmp_path / "run")
  status, out, _ = train(workdir, *COMPILED_LM, "--config.device_memory_gib=0.008", timeout=180)
  assert status == 1, out[-3000:]
  assert "memory: 965.6 KiB planned of 8.2 MiB (config.device_memory_gib=0.008)" in out
  line = next(x for x in out.splitlines() if x.startswith("ConfigError:"))
  size = r"([\d.]+ [KMG]iB)"
  figures = re.search(
      rf"the compiled train step needs {size} per device but config.device_memory_gib=0.008 "
      rf"gives 8.2 MiB per device; temporaries {size} .*; arguments {size} \(params, "
      rf"optimizer state and batch; largest leaves (?:params|opt)/.*; outputs {size} \({size}",
      line,
  )
  assert figures, line
  need, temporaries, arguments, outputs, aliased = map(mib, figures.groups())
  assert need > 8.2 and temporaries > 8 * arguments and arguments > 0.5
  assert need == pytest.approx(temporaries + arguments + outputs - aliased, abs=0.2)
  checked = re.search(
      rf"Would fit: --config.grad_accum_steps=2 \(about {size} of activations a microbatch; "
      rf"checked: {size} per device, fits\), or --config.model.remat=True \(.*; not checked\)",
      line,
  )
  assert checked and mib(checked[2]) < 8.2, line
  assert (
      "a smaller config.batch_size (params, state and batch split further; not checked here)"
      in line
  )
  assert "the train step does not fit: compiling 3 candidates on this host's devices" in out
  assert "initialising params" not in out and "Traceback" not in out
  assert_untouched(workdir)


def mib(text: str) -> float:
  """ "724.1 KiB" (or MiB, GiB) in MiB."""
  number, unit = text.split()
  return float(number) * {"KiB": 2**-10, "MiB": 1, "GiB": 2**10}[unit]


class Entry:

  def __init__(self, name, per_device):
    self.name, self.bytes_per_device = name, per_device


class TwoLeaves:
  """A plan's per-device figures: 3 GiB of params, 3 GiB of optimizer state."""

  entries = (Entry("params/w", 3 * 2**30), Entry("opt/mu/w", 3 * 2**30))
  bytes_per_device = 6 * 2**30


class Cpu:
  platform = "cpu"


def test_memory_check_numbers():
  fits = validation.check_memory(TwoLeaves(), [Cpu()] * 2, host_available=18 * 2**30)
  assert fits.startswith("memory: 18.00 GiB planned of 18.00 GiB")
  with pytest.raises(ConfigError, match=r"needs 18\.00 GiB .* is 17\.00 GiB; .* params/w 3\.00"):
    validation.check_memory(TwoLeaves(), [Cpu()] * 2, host_available=17 * 2**30)


def test_memory_gib_overrides_the_devices_memory():
  """config.device_memory_gib plans another machine: each device's memory, CPU or not."""
  have = memory.budget([Cpu()] * 8, memory_gib=0.5)
  assert (have.total, have.shared_by, have.where) == (2**29, 1, "config.device_memory_gib=0.5")
  assert memory.budget([Cpu()] * 8, host_available=16 * 2**30).per_device == 2 * 2**30
  fits = validation.check_memory(TwoLeaves(), [Cpu()] * 8, memory_gib=9.0)
  assert fits == "memory: 9.00 GiB planned of 9.00 GiB (config.device_memory_gib=9.0)"
  with pytest.raises(ConfigError, match=r"needs 9\.00 GiB .* config.device_memory_gib=8.5 is"):
    validation.check_memory(TwoLeaves(), [Cpu()] * 8, memory_gib=8.5)


def test_compiled_step_figures_and_what_may_fit():
  """4 GiB of params and state, 12 of temporaries on 15 GiB: 2 microbatches may fit (about
  (12 - 3) / 2 GiB of activations beside the 4 + 3 of the rest); remat, bfloat16 state and
  devices too (trainers/fit.py compiles them)."""
  step = memory.StepMemory(
      arguments=4 * GiB, temporaries=12 * GiB, outputs=4 * GiB, aliased=4 * GiB
  )
  config = configs.lm.get_config()  # batch 32: 4 rows a device over 8.
  ok = memory.Budget(16 * GiB, 1, "A")
  assert memory.fits(step, ok) and not memory.fits(step, memory.Budget(15 * GiB, 1, "B"))
  assert memory.fitted(step, ok).startswith(
      "compiled train step: 16.00 GiB per device of 16.00 GiB (A): arguments 4.00"
  )
  error = memory.too_big(step, memory.Budget(15 * GiB, 1, "B"), TwoLeaves())
  assert error.step == step and str(error) == (
      "config.batch_size / config.grad_accum_steps / config.model / config.mesh: the compiled "
      "train step needs 16.00 GiB per device but B gives 15.00 GiB per device; temporaries "
      "12.00 GiB (activations, gradients, XLA's buffers); arguments 4.00 GiB (params, optimizer "
      "state and batch; largest leaves params/w 3.00 GiB, opt/mu/w 3.00 GiB); outputs 4.00 GiB "
      "(4.00 GiB of them written over the donated arguments)"
  )
  found = memory.candidates(step, 15 * GiB, TwoLeaves(), config, rows=4)
  assert [(c.flag, c.why, c.overrides) for c in found] == [
      (
          "--config.grad_accum_steps=2",
          "about 4.50 GiB of activations a microbatch",
          {"grad_accum_steps": 2},
      ),
      (
          "--config.model.remat=True",
          "recompute activations in the backward pass",
          {"model.remat": True},
      ),
      (
          "--config.state_dtype=bfloat16",
          "optimizer state stored in half the bytes",
          {"state_dtype": "bfloat16"},
      ),
      (
          "more devices on a config.mesh axis, or a smaller config.batch_size",
          "params, state and batch split further",
          None,
      ),
  ]
  # Beyond the rows each device holds (4), no microbatch count is suggested; with bfloat16
  # state, bfloat16 params are.
  config.state_dtype = "bfloat16"
  tight = memory.candidates(step, 9 * GiB, TwoLeaves(), config, rows=4)
  assert [c.flag.split("=")[0] for c in tight[:2]] == [
      "--config.model.remat",
      "--config.param_dtype",
  ]
  assert len(tight) == 3
  # With remat on and everything in bfloat16, the next microbatch counts take their places.
  config.model.remat, config.param_dtype = True, "bfloat16"
  counts = memory.candidates(step, 15 * GiB, TwoLeaves(), config, rows=16)
  assert [c.overrides for c in counts[:3]] == [{"grad_accum_steps": n} for n in (2, 4, 8)]
