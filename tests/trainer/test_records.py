"""trainers/input/records.py: the vocabulary and dtype from convert's record, resolved before
planning; contradicting values, files without a record, URLs; and the id scan a corpus without
a record gets once, by process 0 (two real jax.distributed processes), across restarts.
"""

import json
import re
import subprocess
import sys

import numpy as np
import pytest

from configs import lm_data
from tests.helpers import ROOT, environment
from trainers import convert, launch, plan
from trainers.errors import ConfigError
from trainers.input import documents, records, sources

TOKENS = (np.arange(5_000) * 7 % 300).astype(np.uint16)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
  """A byte-level corpus and a BPE one (vocab 300 -> 384), converted by trainers.convert."""
  root = tmp_path_factory.mktemp("records")
  (root / "text").mkdir()
  for i in range(4):
    (root / "text" / f"{i}.txt").write_text(f"document {i} " + "words and more words " * 80)
  corpus = documents.Corpus.of(str(root / "text"))
  convert.convert(corpus, str(root / "bytes"), 0.2)
  convert.convert(corpus, str(root / "bpe"), 0.2, vocab_size=300)  # Trains the BPE first.
  return root


def data_config(root, name, **args):
  arg = f"train={root}/{name}/train.bin,val={root}/{name}/val.bin"
  return lm_data.get_config(",".join([arg, *(f"{k}={v}" for k, v in args.items())]))


def test_vocab_and_dtype_come_from_the_record(converted):
  record = sources.sidecar(f"{converted}/bpe/train.bin")
  config = records.resolve(data_config(converted, "bpe"))
  assert record["vocab_size"] <= 300 and config.model.vocab_size == 384
  assert config.input.dtype == "uint16"
  config = records.resolve(data_config(converted, "bytes"))
  assert (config.model.vocab_size, config.input.dtype) == (256, "uint8")
  config = records.resolve(data_config(converted, "bpe", vocab=512))  # Larger: kept.
  assert config.model.vocab_size == 512


def test_the_planning_command_plans_the_recorded_vocab(converted, capsys):
  arg = f"configs/lm_data.py:train={converted}/bpe/train.bin,val={converted}/bpe/val.bin"
  plan.main(["--config", arg, "--format", "json", "--num_devices", "8"])
  rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)["leaves"]}
  assert rows["params/embed/embedding"]["shape"][0] == 384


@pytest.mark.parametrize(
    "args, message",
    [
        (dict(dtype="uint32"), "config.input.dtype='uint32' contradicts {root}/bpe/train.bin.json"),
        (dict(vocab=256), "config.model.vocab_size=256 is below the"),
    ],
)
def test_a_value_contradicting_the_record_is_one_error(converted, args, message):
  with pytest.raises(ConfigError, match=re.escape(message.format(root=converted))):
    records.resolve(data_config(converted, "bpe", **args))


def test_files_without_a_record_need_a_vocab_and_urls_are_refused(tmp_path):
  TOKENS.tofile(tmp_path / "train.bin")
  config = lm_data.get_config(f"train={tmp_path}/train.bin")
  with pytest.raises(ConfigError, match="config.model.vocab_size is unset and the token files"):
    records.resolve(config)
  config = records.resolve(lm_data.get_config(f"train={tmp_path}/train.bin,vocab=512"))
  assert (config.model.vocab_size, config.input.dtype) == (512, "uint16")  # nanoGPT's dtype
  with pytest.raises(ConfigError, match="is a URL; files are memory-mapped from local disk"):
    records.resolve(lm_data.get_config("train=gs://bucket/owt/train.bin,vocab=512"))


def test_bytes_per_token_make_bits_per_byte(converted):
  config = records.resolve(data_config(converted, "bpe"))
  held_out = sources.open_tokens(sources.input_spec(config.input))[1]
  record = sources.sidecar(f"{converted}/bpe/val.bin")
  assert records.bytes_per_token(held_out, "tokens") == record["text_bytes"] / record["tokens"]
  assert records.bytes_per_token(held_out, "text") == 1.0


# Each process: jax.distributed on 127.0.0.1, then the trainer's id check of one file.
SCAN = """
import sys, jax, numpy as np
from jax.experimental import multihost_utils
port, pid, workdir, path = sys.argv[1:]
jax.config.update("jax_num_cpu_devices", 1)
jax.distributed.initialize(f"127.0.0.1:{port}", 2, int(pid))
from trainers.input import records
scans = records.ScanCache(workdir, jax.process_index() == 0, multihost_utils.broadcast_one_to_all)
print("largest", scans(np.memmap(path, np.uint16, mode="r"), path), "scanned", scans.scanned)
scans.save()
"""


def start_processes(workdir, path) -> list[str]:
  """Two processes of one jax.distributed job, each checking ``path``; their outputs."""
  port = launch.free_port()
  procs = [
      subprocess.Popen(
          [sys.executable, "-c", SCAN, str(port), str(i), str(workdir), str(path)],
          cwd=ROOT,
          env=environment(),
          stdout=subprocess.PIPE,
          stderr=subprocess.STDOUT,
          text=True,
      )
      for i in range(2)
  ]
  outs = [p.communicate(timeout=120)[0] for p in procs]
  assert all(p.returncode == 0 for p in procs), outs
  return [next(line for line in out.splitlines() if line.startswith("largest")) for out in outs]


@pytest.mark.timeout(240)
def test_a_corpus_without_a_record_is_scanned_once_across_processes_and_starts(tmp_path):
  path = tmp_path / "owt.bin"
  TOKENS.tofile(path)  # No record: only a scan finds the largest id.
  first = start_processes(tmp_path / "work", path)
  assert first == ["largest 299 scanned 1", "largest 299 scanned 0"]  # Process 0 only.
  cache = json.loads((tmp_path / "work" / records.SCANS).read_text())
  assert cache[str(path)]["max_token"] == 299
  assert start_processes(tmp_path / "work", path) == ["largest 299 scanned 0"] * 2  # A restart.
  np.append(TOKENS, np.uint16(301)).tofile(path)  # A changed file is scanned again.
  again = records.ScanCache(str(tmp_path / "work"), True)
  assert again(np.memmap(path, np.uint16, mode="r"), str(path)) == 301 and again.scanned == 1
