"""Bad input never costs a run: every mistake is one error of ours before anything is written.

Most cases call the trainer's own checks in-process (cheap); real subprocesses of
`python -m trainers.train` show the same through the entry point: one line naming the key,
exit status 1, nothing allocated, the workdir byte-identical (`trainers.launch`, `trainers.plan`
and `trainers.convert`: tests/e2e/test_<command>.py).
"""

import json
import math
import pathlib
import random

import jax.numpy as jnp
import optax
import pytest

import configs.lm
import configs.vit_digits
from tests.helpers import run_module
from trainers import cli, divergence, validation
from trainers.errors import ConfigError, NonFiniteLossError

SHORT = (
    "--config.total_steps=6",
    "--config.schedule.warmup_steps=2",
    "--config.batch_size=16",
    "--config.seq_len=32",
    "--config.log_every=2",
    "--config.eval_every=6",
    "--config.eval_batches=1",
)
EARLIER = {"config.json": b'{"lr": 0.1}\n', "metrics.jsonl": b'{"step": 1, "loss": 3.0}\n'}


def run(module, *args, env=None, timeout=120):
  """(exit status, stdout + stderr) of ``python -m module args`` from the repo root."""
  done = run_module(module, *args, env=env, timeout=timeout)
  return done.returncode, done.stdout + done.stderr


def used_workdir(path: pathlib.Path) -> pathlib.Path:
  """A workdir holding an earlier run's config.json and metrics.jsonl."""
  path.mkdir()
  for name, content in EARLIER.items():
    (path / name).write_bytes(content)
  return path


def assert_untouched(path: pathlib.Path) -> None:
  assert sorted(p.name for p in path.iterdir()) == sorted(EARLIER)
  for name, content in EARLIER.items():
    assert (path / name).read_bytes() == content


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
  status, out = run(
      "trainers.train", "--config=configs/lm.py", f"--workdir={workdir}", "--config.lr=-0.1"
  )
  assert status == 1 and "ConfigError: config.lr=-0.1: must be a finite number > 0" in out, out
  assert "Traceback" not in out and "initialising params" not in out
  assert_untouched(workdir)


def test_plan_that_cannot_fit_fails_before_init(tmp_path):
  """configs/lm_7b_pod.py on 8 CPU devices: 10 GiB per device, stopped before allocation."""
  workdir = used_workdir(tmp_path / "run")
  status, out = run("trainers.train", "--config=configs/lm_7b_pod.py", f"--workdir={workdir}")
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


def test_diverging_run_stops_with_valid_metrics_and_keeps_the_earlier_run(tmp_path):
  """lr=1e9 trained to the end with loss=nan and wrote bare NaN; now it stops, exit 1.

  The workdir held an earlier run: its files move to attempt-1/, byte-identical. The
  optimizer's keyword arguments come from the command line (--config.optax.b1).
  """
  workdir = used_workdir(tmp_path / "run")
  status, out = run(
      "trainers.train",
      "--config=configs/lm.py",
      f"--workdir={workdir}",
      *SHORT,
      "--config.lr=1e9",
      "--config.optax.b1=0.5",
      timeout=240,
  )
  assert status == 1, out[-3000:]
  line = next(x for x in out.splitlines() if x.startswith("NonFiniteLossError:"))
  assert "the loss is nan" in line and "the last finite loss was" in line and "config.lr" in line
  assert f"moved config.json, metrics.jsonl into {workdir}/attempt-1 (nothing deleted)" in out
  assert_untouched(workdir / "attempt-1")
  records = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
  assert records[0]["step"] == 1 and records[-1]["loss"] is None
  assert records[-1]["stopped"] in line
  assert "NaN" not in (workdir / "metrics.jsonl").read_text()
  assert json.loads((workdir / "config.json").read_text())["optax"] == {"b1": 0.5}


def test_skip_policy_skips_nonfinite_updates_with_real_optax():
  tx = divergence.guard(optax.sgd(0.1), "skip")
  params = {"w": jnp.ones(2)}
  state = tx.init(params)
  updates, state = tx.update({"w": params["w"] * math.nan}, state, params)
  assert float(abs(updates["w"]).sum()) == 0.0
  updates, state = tx.update({"w": params["w"]}, state, params)
  assert float(abs(updates["w"]).sum()) > 0.0
  plain = optax.sgd(0.1)
  assert divergence.guard(plain, "stop") is plain


def test_loss_watch_policies():
  written = []
  stop = divergence.LossWatch("stop", lr=3.0, write=written.append)
  assert stop.observe(1, 2.5) and stop.observe(2, 2.0)
  with pytest.raises(NonFiniteLossError, match="step 3: .* last finite loss was 2 at step 2"):
    stop.observe(3, math.inf)
  assert written == [{"step": 3, "loss": math.inf, "stopped": written[0]["stopped"]}]
  skip = divergence.LossWatch("skip", lr=3.0)
  assert [skip.observe(s, math.nan) for s in range(1, divergence.MAX_SKIPPED)] == [False] * (
      divergence.MAX_SKIPPED - 1
  )
  with pytest.raises(NonFiniteLossError, match="no step had a finite loss"):
    skip.observe(divergence.MAX_SKIPPED, math.nan)


# Config loading: one line naming the file or key, no chained traceback.


def write(path: pathlib.Path, text: str) -> str:
  path.write_text(text)
  return str(path)


@pytest.mark.parametrize(
    "source, message",
    [
        ("def get_config(:\n", "syntax error in {path} line 1"),
        ("x = 1\n", "{path} defines no get_config()"),
        ("import not_a_module_here\n", "loading {path} raised ModuleNotFoundError"),
        ("def get_config(arg=None):\n  return 1 / 0\n", "get_config() raised: division by zero"),
        ("def get_config(arg=None):\n  return None\n", "get_config() returned NoneType"),
    ],
)
def test_config_file_mistakes(tmp_path, source, message):
  path = write(tmp_path / "c.py", source)
  with pytest.raises(ConfigError, match=f"--config={path}: .*") as e:
    cli.load_config(path)
  assert message.format(path=path) in str(e.value)


def test_missing_config_and_missing_file(tmp_path):
  with pytest.raises(ConfigError, match="--config is missing"):
    cli.config_spec(["train", "--workdir=/tmp/x"])
  assert cli.config_spec(["train", "--config", "a.py:x"]) == "a.py:x"
  with pytest.raises(ConfigError, match=r"file 'configs/lmm\.py' not found; did you mean 'lm\.py'"):
    cli.load_config("configs/lmm.py")
  with pytest.raises(ConfigError, match=r"get_config\('sise=small'\) raised: config arg 'sise"):
    cli.load_config("configs/lm.py:sise=small")
  assert cli.load_config("configs/lm.py:size=small").model.size == "small"


def test_override_of_an_unknown_key_names_the_closest():
  config = configs.lm.get_config()
  cli.check_overrides(config, {"lr": 1.0, "model.size": "small", "optax.b1": 0.9}, "c.py")
  with pytest.raises(ConfigError, match=r"--config\.lrr: c\.py has no key config\.lrr; did you"):
    cli.check_overrides(config, {"lrr": 1.0}, "c.py")
  with pytest.raises(ConfigError, match=r"config\.model\.sise; did you mean 'size'"):
    cli.check_overrides(config, {"model.sise": 1}, "c.py")
  with pytest.raises(ConfigError, match=r"config\.lr\.x"):
    cli.check_overrides(config, {"lr.x": 1}, "c.py")


def test_config_loading_errors_through_the_entry_point(tmp_path):
  """Each is one line and exit status 1; --debug (BV_DEBUG=1) shows the traceback."""
  bad = write(tmp_path / "bad.py", "def get_config(:\n")
  cases = [
      ((f"--workdir={tmp_path}",), "ConfigError: --config is missing"),
      ((f"--config={bad}", f"--workdir={tmp_path}"), f"ConfigError: --config={bad}: syntax error"),
      (
          ("--config=configs/lm.py", "--config.lrr=1", f"--workdir={tmp_path}"),
          "ConfigError: --config.lrr: configs/lm.py has no key config.lrr; did you mean 'lr'?",
      ),
      (
          ("--config=configs/lm.py", "--config.lr=abc", f"--workdir={tmp_path}"),
          "ConfigError: command line: flag --config.lr=abc",
      ),
  ]
  for args, message in cases:
    status, out = run("trainers.train", *args)
    assert status == 1 and out.startswith(message), out
    assert "Traceback" not in out and len(out.strip().splitlines()) == 1, out
  assert list(tmp_path.iterdir()) == [pathlib.Path(bad)]
  status, out = run(
      "trainers.train", f"--config={bad}", f"--workdir={tmp_path}", env={"BV_DEBUG": "1"}
  )
  assert status != 0 and "Traceback" in out and "syntax error" in out
