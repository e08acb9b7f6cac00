"""From a folder of documents to a trained model and a sample, as a user runs it: convert with a
trained BPE, `python -m trainers.train` on 4 devices with vocab_size from the record (the loss
falls, evals report bits per byte), then `python -m trainers.sample` on 2 devices.
"""

import json
import math
import random
import shutil

import numpy as np
import pytest

from configs import lm_data
from tests.helpers import assert_snake_case_help, help_text, run_module, train
from trainers import convert, sample
from trainers.errors import ConfigError
from trainers.input import sources

WORDS = "the quick brown fox jumps over lazy dog and cat runs far away from home".split()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """(workdir, data directory, the run's output) of one short run on a converted corpus."""
  root = tmp_path_factory.mktemp("language")
  rng = random.Random(0)
  (root / "docs").mkdir()
  for i in range(40):
    words = " ".join(rng.choice(WORDS) for _ in range(300))
    (root / "docs" / f"{i:03}.txt").write_text(words + ".\n")
  data = root / "data"
  convert.main([str(root / "docs"), str(data), "--train_tokenizer", "--vocab_size=300"])
  status, out, records = train(
      root / "run",
      "--devices_per_process=4",
      "--config.total_steps=30",
      "--config.batch_size=16",
      "--config.seq_len=64",
      "--config.log_every=10",
      "--config.eval_every=30",
      "--config.eval_batches=2",
      "--config.schedule.warmup_steps=5",
      config=f"configs/lm_data.py:train={data}/train.bin,val={data}/val.bin",
  )
  assert status == 0, out[-3000:]
  return root / "run", data, out, records


@pytest.mark.timeout(240)
@pytest.mark.xdist_group("language-trained")  # One worker makes `trained` for both.
def test_training_takes_the_vocab_from_the_record_and_the_loss_falls(trained):
  workdir, data, out, records = trained
  record = sources.sidecar(f"{data}/val.bin")
  assert record["vocab_size"] <= 300 and record["eot_id"] == 0
  config = json.loads((workdir / "config.json").read_text())
  assert config["model"]["vocab_size"] == 384 and config["input"]["dtype"] == "uint16"
  assert records[-1]["loss"] < 0.5 * records[0]["loss"], records
  bits = records[-1]["eval_loss"] / math.log(2) * record["tokens"] / record["text_bytes"]
  assert records[-1]["eval_bits_per_byte"] == pytest.approx(bits, rel=1e-6)
  assert "eval_bits_per_byte=" in out


@pytest.mark.timeout(120)
@pytest.mark.xdist_group("language-trained")  # One worker makes `trained` for both.
def test_sampling_on_other_devices_writes_the_corpus_words(trained):
  workdir = trained[0]
  done = run_module(
      "trainers.sample",
      f"--workdir={workdir}",
      "--prompt=the quick",
      "--max_new_tokens=80",  # Past the 64-token window: the cache is refilled once.
      "--temperature=0",
      "--devices_per_process=2",
      timeout=100,
  )
  assert done.returncode == 0, done.stderr[-3000:]
  assert f"sampling from {workdir}/checkpoints/30 on 2 devices" in done.stderr
  assert "WARNING" not in done.stderr, done.stderr  # orbax's read-only notes are dropped.
  text = done.stdout.strip()
  assert text.startswith("the quick") and len(text) > len("the quick") + 10, text
  assert set(text.split()[:-1]) <= set(WORDS), text  # The last word may be cut short.


@pytest.mark.timeout(120)
@pytest.mark.xdist_group("language-trained")
def test_sampling_a_damaged_checkpoint_is_one_line_naming_it(trained, tmp_path):
  workdir = tmp_path / "run"
  shutil.copytree(trained[0], workdir)
  data = max((workdir / "checkpoints/30/params").rglob("d/*"), key=lambda p: p.stat().st_size)
  raw = bytearray(data.read_bytes())
  raw[len(raw) // 2 : len(raw) // 2 + 64] = bytes(b ^ 0xFF for b in raw[len(raw) // 2 :][:64])
  data.write_bytes(bytes(raw))
  done = run_module("trainers.sample", f"--workdir={workdir}", "--prompt=the", timeout=100)
  assert done.returncode == 1 and done.stdout == "", done.stderr[-3000:]
  last = done.stderr.splitlines()[-1]
  assert last.startswith(f"DamagedCheckpointError: checkpoint {workdir}/checkpoints/30: params/")
  assert last.endswith(
      "does not match the checksum saved with it (its data files were changed after the save)"
  )


def test_a_workdir_without_a_run_is_one_line(tmp_path, capsys):
  with pytest.raises(SystemExit) as exited:
    sample.main([f"--workdir={tmp_path}", "--prompt=hi"])
  err = capsys.readouterr().err
  assert exited.value.code == 1 and err.startswith(f"ConfigError: --workdir={tmp_path} has no")
  assert len(err.splitlines()) == 1


@pytest.mark.parametrize("text", ["[1, 2]", "{not json", "\udcff"])
def test_a_config_json_that_is_not_an_object_is_one_line(tmp_path, capsys, text):
  (tmp_path / "config.json").write_text(text, errors="surrogateescape")
  with pytest.raises(SystemExit) as exited:
    sample.main([f"--workdir={tmp_path}", "--prompt=hi"])
  err = capsys.readouterr().err
  assert exited.value.code == 1 and len(err.splitlines()) == 1
  assert err.startswith(f"ConfigError: --workdir={tmp_path}: config.json is not a JSON object")


@pytest.mark.parametrize(
    ("flag", "fragment"),
    [
        ("--temperature=nan", "--temperature: 'nan' is not a finite number >= 0"),
        ("--seed=-1", "--seed: '-1' is not an integer >= 0"),
        ("--devices_per_process=0", "--devices_per_process: '0' is not an integer >= 1"),
    ],
)
def test_a_bad_sampling_flag_is_one_line(tmp_path, capsys, flag, fragment):
  with pytest.raises(SystemExit) as exited:
    sample.main([f"--workdir={tmp_path}", flag])
  err = capsys.readouterr().err
  assert exited.value.code == 1 and err.startswith("ConfigError: argument ") and fragment in err
  assert len(err.splitlines()) == 1


def test_non_finite_logits_are_one_line_naming_the_checkpoint():
  with pytest.raises(ConfigError, match="runs/x/checkpoints/4 gives non-finite logits"):
    sample.finite(np.array([0.0, np.nan]), "runs/x/checkpoints/4")


def test_help_shows_snake_case_flags_only(capsys):
  assert_snake_case_help(
      help_text(sample.main, capsys), "--max_new_tokens", "--devices_per_process"
  )


def test_a_tokenizer_swapped_after_conversion_is_one_line(tmp_path):
  (tmp_path / "docs").mkdir()
  (tmp_path / "docs" / "a.txt").write_text(" ".join(WORDS * 20) + ".\n")
  data = tmp_path / "data"
  convert.main([str(tmp_path / "docs"), str(data), "--train_tokenizer", "--vocab_size=300"])
  config = lm_data.get_config(f"train={data}/train.bin,val={data}/val.bin")
  assert sample.run_tokenizer(config)[2] <= 300  # The recorded one: accepted.
  path = sources.sidecar(f"{data}/train.bin")["tokenizer"]
  other = json.loads(open(path).read())
  other["model"]["vocab"] = {
      t: (i + 1) % len(other["model"]["vocab"]) for t, i in other["model"]["vocab"].items()
  }
  with open(path, "w") as f:
    json.dump(other, f)
  with pytest.raises(ConfigError, match=f"{path} is not the tokenizer .*train.bin was made with"):
    sample.run_tokenizer(config)
