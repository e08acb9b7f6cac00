"""trainers/validation.py: bad input never costs a run, one error of ours before anything is written.

Most cases call the trainer's own checks in-process (cheap); real ``python -m trainers.train``
runs show the same through the entry point: one line naming the key, exit status 1, nothing
allocated, the workdir byte-identical (``trainers.launch``, ``trainers.plan`` and
``trainers.convert``: tests/e2e/test_<command>.py).
"""

import math
import random

import pytest

import configs.lm
import configs.vit_digits
from tests.helpers import assert_untouched, train, used_workdir
from trainers import validation
from trainers.errors import ConfigError


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
FLOAT_KEYS = {"lr": True, "grad_clip_norm": True, "wd": False, "schedule.linear_end": False}


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
      if key == "grad_clip_norm" and value is None:
        continue  # None turns clipping off.
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
        ({"schedule.decay_type": "cosin"}, "config.schedule.decay_type"),
        ({"schedule": {"warmup": 10}}, "config.schedule.warmup"),
        ({"schedule": 3}, "config.schedule"),
        ({"optax": 0.9}, "config.optax"),
        ({"profile_steps": (3, 3)}, "config.profile_steps"),
        ({"profile_steps": (0, 2)}, "config.profile_steps"),
        ({"profile_steps": (2,)}, "config.profile_steps"),
        ({"profile_steps": (2.0, 4)}, "config.profile_steps"),
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


def test_memory_check_numbers():
  class Entry:

    def __init__(self, name, per_device):
      self.name, self.bytes_per_device = name, per_device

  class Plan:
    entries = (Entry("params/w", 3 * 2**30), Entry("opt/mu/w", 3 * 2**30))
    bytes_per_device = 6 * 2**30

  class Cpu:
    platform = "cpu"

  fits = validation.check_memory(Plan(), [Cpu()] * 2, host_available=18 * 2**30)
  assert fits.startswith("memory: 18.00 GiB planned of 18.00 GiB")
  with pytest.raises(ConfigError, match=r"needs 18\.00 GiB .* is 17\.00 GiB; .* params/w 3\.00"):
    validation.check_memory(Plan(), [Cpu()] * 2, host_available=17 * 2**30)
