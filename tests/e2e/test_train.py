"""trainers/train.py through the command line users run, on 8 simulated CPU devices.

Each run is a subprocess ``python -m trainers.train --config configs/... --config.k=v``;
overriding ``--config.optax_name`` is the only change between the optimizer runs. Runs on
data written here (token files, a text directory, .npy images: configs/lm_data.py,
configs/vit_images.py) must lower the loss too, and two SLURM-style processes start
jax.distributed from the environment. Its flags
(help, dashed spellings, a bad value) are parsed in process, on absl's flags.
"""

import json
import math
import os
import pathlib
import re
import subprocess
import sys
import time

import numpy as np
import pytest
from absl import flags

from tests.helpers import ROOT, SLURM, assert_snake_case_help, quick_lm, train
from trainers import launch
from trainers.rundir import events
from trainers.settings import cli

SHORT = quick_lm(total_steps=30, log_every=10, eval_every=30, eval_batches=2)


def trained(workdir, *overrides, config="configs/lm.py"):
  """Runs the trainer, which must succeed; returns (output, metrics records)."""
  status, out, records = train(workdir, *overrides, config=config)
  assert status == 0, out[-3000:]
  return out, records


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "optimizer, config, dtype",
    [
        ("adamw", "configs/lm.py", "float32"),
        ("kron", "configs/lm.py:layers=1", "bfloat16"),
        ("shampoo", "configs/lm.py:layers=1", "bfloat16"),
        ("shampoo", "configs/lm_shampoo.py:layers=1", "float32"),
        ("muon", "configs/lm.py:layers=1", "bfloat16"),
    ],
)
def test_lm_loss_falls_and_state_matches_plan(tmp_path, optimizer, config, dtype):
  """Also: the step metrics and throughput in every record, TensorBoard scalars equal to
  them, and a profile of step 2 (``config.profile_steps``); "bfloat16" computes and keeps
  the optimizer state in bfloat16 (params float32). The README's job as it is (adamw), the
  optimizers it swaps in on the one-layer model (``layers=1``: every kind of param, in about
  half the compile)."""
  out, records = trained(
      tmp_path,
      *SHORT,
      f"--config.optax_name={optimizer}",
      f"--config.compute_dtype={dtype}",
      f"--config.state_dtype={dtype}",
      "--config.profile_steps=(2, 3)",
      config=config,
  )
  assert [r["step"] for r in records] == [1, 10, 20, 30]
  assert records[-1]["loss"] < records[0]["loss"] - 1.0, records
  assert "eval_loss" in records[-1] and all(k in records[0] for k in ("lr", "steps_per_sec"))
  for record in records:
    assert all(record[k] > 0 for k in ("l2_grads", "l2_params", "tokens_per_sec"))
    assert record["tflops_per_device"] > 0 and record["mfu"] is None  # CPU: no known peak.
    assert record["flops_source"] == "jaxpr" and record["flops_per_step"] > 0
  assert records[0]["l2_updates"] == 0.0 < records[-1]["l2_updates"]  # lr 0 at step 1.
  curves = events.read_scalars(tmp_path / "tensorboard")
  for key in ("loss", "l2_grads", "tflops_per_device", "eval_loss"):
    want = [(r["step"], pytest.approx(r[key], rel=1e-6)) for r in records if key in r]
    assert curves[key] == want, key
  assert "mfu" not in curves and "flops_source" not in curves
  assert list((tmp_path / "profile").glob("plugins/profile/*/*.xplane.pb"))
  logged = [line for line in out.splitlines() if re.match(r"[IWE]\d{4} ", line)]
  assert logged[0].endswith(
      "] cpu: process 0 of 1, 8 devices (8 here); jax.distributed: single process"
  )
  # The plan's summary is logged; its whole table goes to the start's folder.
  assert "% of the 8-way split" in out and "MiB/device  why" not in out  # No table header.
  table = (tmp_path / "starts" / "0" / "plan.txt").read_text()
  assert table.startswith("name ") and "params/embed/embedding" in table and "\nopt/" in table
  assert "state shardings match the plan after init" in out
  assert "state shardings match the plan after the first step" in out
  assert "step 30/30 loss=" in out and "tokens/s/device=" in out and "MFU=null" in out
  orbax = ("checkpoint_manager.py:", "checkpoint_handler.py:", "temporary_paths.py:")
  assert [line for line in out.splitlines() if any(f in line for f in orbax)] == []
  config = json.loads(pathlib.Path(tmp_path, "config.json").read_text())
  assert (config["optax_name"], config["compute_dtype"], config["state_dtype"]) == (
      optimizer,
      dtype,
      dtype,
  )


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
  table = (tmp_path / "starts" / "0" / "plan.txt").read_text()  # The plan's whole table.
  assert "P('data', 'model')" in table and "logical_partitioning: dim 0 over data" in table
  assert records[-1]["loss"] < records[0]["loss"], records


@pytest.mark.timeout(120)
def test_vit_digits_runs(tmp_path):
  steps = ("--config.total_steps=5", "--config.log_every=5", "--config.eval_every=5")
  out, records = trained(tmp_path, *steps, config="configs/vit_digits.py")
  assert [r["step"] for r in records] == [1, 5] and "eval_loss" in records[-1]
  assert "images/s/device=" in out and records[-1]["images_per_sec"] > 0


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
  assert_snake_case_help(text, "--config", "--workdir", "--devices_per_process", "--debug")


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


def learnable_tokens(n, vocab=512, period=97, seed=0):
  """A cycle of `period` distinct ids < vocab, repeated: each id predicts the next."""
  cycle = np.random.default_rng(seed).permutation(vocab)[:period].astype(np.uint16)
  return np.resize(cycle, n)


def labelled_images(n, seed=0):
  """8x8x1 uint8 images whose class (0-3) is the bright quadrant, with noise."""
  rng = np.random.default_rng(seed)
  labels = rng.integers(0, 4, n)
  images = rng.integers(0, 60, (n, 8, 8, 1)).astype(np.uint8)
  for k in range(4):
    rows, cols = divmod(k, 2)
    images[labels == k, 4 * rows : 4 * rows + 4, 4 * cols : 4 * cols + 4] += 180
  return images, labels


def write_data(root):
  """The three inputs; returns the config argument for each."""
  tokens = root / "tokens"
  tokens.mkdir()
  learnable_tokens(40_000).tofile(tokens / "train.bin")
  learnable_tokens(4_000, seed=0).tofile(tokens / "val.bin")
  text = root / "text" / "nested"
  text.mkdir(parents=True)
  for i in range(3):
    (text / f"{i}.txt").write_text("The quick brown fox jumps over the lazy dog. " * 300)
  for split, n in (("train", 2_000), ("val", 256)):
    (root / "images" / split).mkdir(parents=True)
    images, labels = labelled_images(n, seed=len(split))
    np.save(root / "images" / split / "images.npy", images)
    np.save(root / "images" / split / "labels.npy", labels)
  return {
      "tokens": (
          f"configs/lm_data.py:train={tokens}/train.bin,val={tokens}/val.bin,vocab=512",
          "tokens/s/device=",
      ),
      "text": (f"configs/lm_data.py:kind=text,train={root}/text", "tokens/s/device="),
      "images": (
          f"configs/vit_images.py:train={root}/images/train,val={root}/images/val,classes=4",
          "images/s/device=",
      ),
  }


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
  return write_data(tmp_path_factory.mktemp("own_data"))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", ["tokens", "text", "images"])
def test_training_on_own_data_lowers_the_loss(tmp_path, inputs, kind):
  config, unit = inputs[kind]
  # The ViT config has no seq_len and sets its warmup as a percent of total_steps.
  overrides = (
      SHORT if kind != "images" else [s for s in SHORT if "seq_len" not in s and "warmup" not in s]
  )
  status, out, records = train(tmp_path, *overrides, config=config)
  assert status == 0, out[-3000:]
  assert [r["step"] for r in records] == [1, 10, 20, 30]
  assert records[-1]["loss"] < 0.8 * records[0]["loss"], records
  assert "eval_loss" in records[-1] and unit in out
  if kind == "text":  # Bytes: one byte a token, so bits per byte are the loss in bits.
    assert records[-1]["eval_bits_per_byte"] == records[-1]["eval_loss"] / math.log(2)


@pytest.mark.timeout(120)
def test_bad_input_fails_before_init(tmp_path, inputs):
  tokens_config, _ = inputs["tokens"]
  status, out, records = train(
      tmp_path, *SHORT, config=tokens_config.replace("vocab=512", "vocab=256")
  )
  assert status != 0
  assert "train.bin holds token id 503" in out and "set config.model.vocab_size=" in out, out[
      -3000:
  ]
  assert "ConfigError" in out and "initialising params" not in out and records == []


def slurm_env(process: int, port: int) -> dict:
  """What `srun -n 2` sets for task `process` on this host (jax's SLURM detection reads these)."""
  values = ("7", "127.0.0.1", "2", str(process), str(process))
  return {
      **os.environ,
      **dict(zip(SLURM, values)),
      "JAX_COORDINATOR_PORT": str(port),
      "JAX_PLATFORMS": "cpu",
  }


@pytest.mark.timeout(240)
def test_processes_with_different_configs_stop_naming_the_first_differing_key(tmp_path):
  """Two SLURM-style tasks, no coordinator flags: jax.distributed starts from the environment,
  and process 1 (another optimizer) makes both stop before allocating, naming the key
  (trainers/hosts/same_job.py, before the plans are compared)."""
  port = launch.free_port()
  common = [
      "--config=configs/lm.py",
      "--devices_per_process=4",
      "--config.batch_size=16",
      "--config.seq_len=64",
  ]
  procs = [
      subprocess.Popen(
          [
              sys.executable,
              "-m",
              "trainers.train",
              f"--workdir={tmp_path / 'run'}",
              *common,
              *extra,
          ],
          cwd=ROOT,
          env=slurm_env(i, port),
          stdout=subprocess.PIPE,
          stderr=subprocess.STDOUT,
          text=True,
      )
      for i, extra in enumerate([[], ["--config.optax_name=lion"]])
  ]
  outs = [p.communicate(timeout=200)[0] for p in procs]
  for i, (p, out) in enumerate(zip(procs, outs)):
    assert p.returncode != 0, out[-2000:]
    # The start-up's lines are held until the checks pass (trainers/settings/held.py): the
    # error, which names the other process of the job Slurm's variables declared, comes first.
    assert not re.search(r"^[IW]\d{4} ", out, re.M), out[-2000:]
    here, there = ("'adamw'", "'lion'") if i == 0 else ("'lion'", "'adamw'")
    assert f"ConfigError: config.optax_name={here} here, {there} on process {1 - i}" in out
    assert "initialising params" not in out  # Stopped before allocating.
