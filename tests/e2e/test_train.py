"""trainers/train.py through the command line users run, on 8 simulated CPU devices.

Each run is a subprocess ``python -m trainers.train --config configs/... --config.k=v``;
overriding ``--config.optax_name`` is the only change between the optimizer runs. Its flags
(help, dashed spellings, a bad value) are parsed in process, on absl's flags.
"""

import json
import math
import os
import pathlib
import re
import time

import pytest
from absl import flags

from tests.helpers import quick_lm, run_module
from trainers import cli

SHORT = quick_lm(total_steps=30, log_every=10, eval_every=30, eval_batches=2)


def train(workdir, *overrides, config="configs/lm.py", timeout=240):
  """Runs the trainer; returns (exit status, output, metrics records)."""
  done = run_module(
      "trainers.train", f"--config={config}", f"--workdir={workdir}", *overrides, timeout=timeout
  )
  path = pathlib.Path(workdir, "metrics.jsonl")
  records = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
  return done.returncode, done.stdout + done.stderr, records


def trained(workdir, *overrides, config="configs/lm.py"):
  """Runs the trainer, which must succeed; returns (output, metrics records)."""
  status, out, records = train(workdir, *overrides, config=config)
  assert status == 0, out[-3000:]
  return out, records


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "optimizer, config",
    [
        ("adamw", "configs/lm.py"),
        ("kron", "configs/lm.py"),
        ("shampoo", "configs/lm.py"),
        ("shampoo", "configs/lm_shampoo.py"),
    ],
)
def test_lm_loss_falls_and_state_matches_plan(tmp_path, optimizer, config):
  out, records = trained(tmp_path, *SHORT, f"--config.optax_name={optimizer}", config=config)
  assert [r["step"] for r in records] == [1, 10, 20, 30]
  assert records[-1]["loss"] < records[0]["loss"] - 1.0, records
  assert "eval_loss" in records[-1] and all(k in records[0] for k in ("lr", "steps_per_sec"))
  assert "state shardings match the plan after init" in out
  assert "state shardings match the plan after the first step" in out
  assert "step 30/30 loss=" in out and "tokens/s=" in out
  config = json.loads(pathlib.Path(tmp_path, "config.json").read_text())
  assert config["optax_name"] == optimizer


@pytest.mark.timeout(240)
def test_big_vision_optimizer_section_trains_and_logs_the_lr_it_applies(tmp_path):
  """big_vision's spelling: an optax attribute as optax_name, schedule.decay_type."""
  _, records = trained(
      tmp_path,
      *SHORT,
      "--config.optax_name=scale_by_adam",
      "--config.schedule.decay_type=cosine",
      "--config.schedule.warmup_steps=5",
  )
  assert records[-1]["loss"] < records[0]["loss"] - 1.0, records
  lr, total = 3e-3, 30  # configs/lm.py's lr; cosine multiplier after 5 warmup steps
  for r in records:
    progress = max(r["step"] - 1 - 5, 0) / (total - 5)
    expected = lr * min((r["step"] - 1) / 5, 1.0) * 0.5 * (1 + math.cos(math.pi * progress))
    assert r["lr"] == pytest.approx(expected, rel=1e-5, abs=1e-9), r


@pytest.mark.timeout(240)
def test_lm_rules_places_params_by_logical_names_and_trains(tmp_path):
  steps = ("--config.total_steps=12", "--config.log_every=6")
  out, records = trained(tmp_path, *SHORT, *steps, config="configs/lm_rules.py")
  assert "state shardings match the plan after the first step" in out
  assert "P('data', 'model')" in out and "logical_partitioning: dim 0 over data" in out
  assert records[-1]["loss"] < records[0]["loss"], records


@pytest.mark.timeout(120)
def test_vit_digits_runs(tmp_path):
  steps = ("--config.total_steps=5", "--config.log_every=5", "--config.eval_every=5")
  out, records = trained(tmp_path, *steps, config="configs/vit_digits.py")
  assert [r["step"] for r in records] == [1, 5] and "eval_loss" in records[-1]
  assert "images/s=" in out


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "override, message",
    [
        (
            "--config.optax_name=adamww",
            "config.optax_name='adamww' is neither one of the project's optimizers",
        ),
        (
            "--config.mesh=(('data', 3),)",
            "ShardingError: config.mesh [('data', 3)] covers 3 devices but there are 8",
        ),
        (
            "--config.batch_size=30",
            "ConfigError: config.batch_size=30 must be a positive multiple of 8",
        ),
    ],
)
def test_bad_config_fails_before_init(tmp_path, override, message):
  start = time.monotonic()
  status, out, records = train(tmp_path, override, timeout=60)
  assert status != 0
  assert message in out, out[-3000:]
  assert "Traceback" not in out and "initialising params" not in out and records == []
  assert any(kind in out for kind in ("ShardingError", "ConfigError", "OptimizerError"))
  assert not os.path.exists(tmp_path / "config.json")
  assert time.monotonic() - start < 60


@pytest.fixture
def train_flags():
  """The trainer's flags, defined on absl's FLAGS by importing it; unparsed afterwards."""
  from trainers import train

  yield train
  flags.FLAGS.unparse_flags()


def test_help_shows_snake_case_flags_only(train_flags):
  text = flags.FLAGS.module_help(train_flags) + train_flags.__doc__
  for flag in ("--config", "--workdir", "--devices_per_process", "--debug"):
    assert flag in text
  assert not re.search(r"--[a-z0-9]+-[a-z0-9]", text), text


def test_dashed_flags_still_work_with_a_note(train_flags, tmp_path, capsys):
  argv = ["train", "--config=configs/lm.py", f"--workdir={tmp_path}", "--devices-per-process=2"]
  cli.parse_flags(argv)
  assert flags.FLAGS.devices_per_process == 2
  assert (
      capsys.readouterr().err == "--devices-per-process is deprecated: use --devices_per_process\n"
  )


def test_bad_flag_is_one_config_error_line_and_exit_1(train_flags, capsys):
  with pytest.raises(SystemExit) as exited:
    cli.parse_flags(["train", "--config=configs/lm.py", "--devices_per_process=2"])
  err = capsys.readouterr().err
  assert exited.value.code == 1 and len(err.splitlines()) == 1, err
  assert err.startswith("ConfigError: command line: flag --workdir=None: Flag --workdir must have")
