"""`python -m trainers.convert CORPUS OUT_DIR`, in process: text files, JSONL and Parquet streamed
into token files (bytes, a trained BPE, a given tokenizer.json), end-of-text ids between
documents, the records' counts, and each bad input one line, exit status 1, nothing written.
"""

import json
import shutil
import signal
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pytest
from pyarrow import parquet

from tests.helpers import ROOT, assert_snake_case_help, environment, help_text
from trainers import convert
from trainers.input import documents, sources
from trainers.input import tokenizer as tokenizers_lib

DOCS = [f"document {i}: ünïcode wörds, " + "some more words here. " * (3 + 7 * i) for i in range(9)]


def test_convert_streams_text_into_token_files(tmp_path, capsys, monkeypatch):
  monkeypatch.setattr(documents, "CHUNK", 100)  # Many pieces, and a cut inside one.
  monkeypatch.setattr(convert, "BATCH", 150)
  corpus = tmp_path / "corpus"
  corpus.mkdir()
  texts = ["ünïcode text, first file. " * 30, "second file. " * 40]
  for i, text in enumerate(texts):
    (corpus / f"{i}.txt").write_text(text)
  raw = b"".join(t.encode() for t in texts)
  convert.main([str(corpus), str(tmp_path / "out"), "--val_fraction=0.1", "--dtype=uint16"])
  out = capsys.readouterr()
  assert out.err.splitlines()[-1].startswith("converted 0.0 / 0.0 MiB (100%), ")
  assert out.err.splitlines()[-1].endswith(", ETA 00:00:00")
  assert "configs/lm_data.py:train=" in out.out
  cut = len(raw) - round(len(raw) * 0.1)
  train = np.fromfile(tmp_path / "out" / "train.bin", np.uint16)
  val = np.fromfile(tmp_path / "out" / "val.bin", np.uint16)
  np.testing.assert_array_equal(np.concatenate([train, val]), np.frombuffer(raw, np.uint8))
  assert len(train) == cut
  record = json.loads((tmp_path / "out" / "train.bin.json").read_text())
  assert record == {
      "dtype": "uint16",
      "tokens": cut,
      "documents": 1,  # The second file is cut: its head ends train.bin.
      "text_bytes": cut,
      "max_token": int(max(raw[:cut])),
      "vocab_size": 256,
      "eot_id": None,
      "tokenizer": None,
      "tokenizer_sha256": None,
  }
  written = sources.input_config(kind="tokens", train=str(tmp_path / "out"))
  whole = sources.token_stream(sources.input_spec(written), "train")
  assert [n.rsplit("/", 1)[1] for n in whole.names] == ["train.bin", "val.bin"]  # No .json.


def write_corpus(root, form: str) -> str:
  """DOCS as text files (one each, and a binary file to skip), one JSONL or one Parquet file."""
  root.mkdir()
  if form == "text":
    for i, doc in enumerate(DOCS):
      (root / f"{i:02}.txt").write_text(doc)
    (root / "compiled.pyc").write_bytes(b"\x00\x01\xff\xfe binary")
    return str(root)
  if form == "separated":  # One file, the documents between separators (TinyStories' form).
    (root / "stories.txt").write_text("<|endoftext|>".join(["", *DOCS, "  "]))
    return str(root / "stories.txt")
  if form == "jsonl":
    lines = [json.dumps({"id": i, "body": doc}) for i, doc in enumerate(DOCS)]
    (root / "docs.jsonl").write_text("\n".join(lines) + "\n")
    return str(root / "docs.jsonl")
  table = pa.table({"id": list(range(len(DOCS))), "body": DOCS})
  parquet.write_table(table, root / "docs.parquet", row_group_size=4)
  return str(root / "docs.parquet")


@pytest.fixture(scope="module")
def given_tokenizer(tmp_path_factory):
  """A tokenizer.json made elsewhere: a tiny BPE trained with `tokenizers` on other text."""
  path = str(tmp_path_factory.mktemp("tokenizer") / "tokenizer.json")
  tokenizers_lib.train_bpe(iter(["other words, other text. " * 20] * 10), 320, path)
  return path


@pytest.mark.parametrize("form", ["text", "separated", "jsonl", "parquet"])
@pytest.mark.parametrize("how", ["trained", "given"])
def test_documents_end_with_the_end_of_text_id(tmp_path, capsys, given_tokenizer, form, how):
  corpus = write_corpus(tmp_path / "corpus", form)
  out = tmp_path / "out"
  tokenizer = ["--train_tokenizer", "--vocab_size=400"] if how == "trained" else []
  tokenizer = tokenizer or [f"--tokenizer={given_tokenizer}"]
  field = {"text": [], "separated": ["--separator=<|endoftext|>"]}.get(form, ["--text_field=body"])
  convert.main([corpus, str(out), "--val_fraction=0.2", "--workers=1", *tokenizer, *field])
  err = capsys.readouterr().err
  assert ("skipped 1 files that are not UTF-8 text: " in err) == (form == "text"), err
  path = str(out / "tokenizer.json") if how == "trained" else given_tokenizer
  tok = tokenizers_lib.load(path)
  records = [sources.sidecar(str(out / f"{s}.bin")) for s in ("train", "val")]
  ids = [np.fromfile(out / f"{s}.bin", r["dtype"]) for s, r in zip(("train", "val"), records)]
  eot = tok.token_to_id("<|endoftext|>")
  for record, split in zip(records, ids):
    assert record["dtype"] == "uint16" and record["eot_id"] == eot
    assert record["tokens"] == len(split) and record["max_token"] == split.max()
    assert record["vocab_size"] == tok.get_vocab_size() and record["tokenizer"] == path
    assert record["tokenizer_sha256"] == tokenizers_lib.sha256(path)
  assert [r["documents"] for r in records] == [int((i == eot).sum()) for i in ids]
  assert sum(r["documents"] for r in records) == len(DOCS) and records[1]["documents"] >= 1
  assert sum(r["text_bytes"] for r in records) == sum(len(d.encode()) for d in DOCS)
  whole = np.concatenate(ids)
  assert whole[-1] == eot  # Every document, the last too, ends with the id; none is empty.
  ends = np.flatnonzero(whole == eot)
  texts = [tok.decode(part.tolist()) for part in np.split(whole, ends + 1)[:-1]]
  assert [t.removesuffix("<|endoftext|>") for t in texts] == DOCS


def test_workers_write_what_one_process_writes(tmp_path, given_tokenizer, monkeypatch):
  monkeypatch.setattr(convert, "BATCH", 200)  # Many batches in flight at once.
  corpus = documents.Corpus.of(write_corpus(tmp_path / "corpus", "jsonl"), "body")
  for workers in (1, 2):
    convert.convert(corpus, str(tmp_path / f"w{workers}"), 0.2, given_tokenizer, workers=workers)
  for name in ("train.bin", "val.bin", "train.bin.json", "val.bin.json"):
    assert (tmp_path / "w1" / name).read_bytes() == (tmp_path / "w2" / name).read_bytes(), name


def visible(out) -> dict:
  """The output as a reader sees it: each file by its name (hidden and temporary ones left
  out), its record parsed."""
  files = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file() and p.name[0] != "."}
  files = {n: data for n, data in files.items() if ".partial-" not in n}
  return {n: json.loads(b) if n.endswith(".json") else b for n, b in files.items()}


def committed_listing(out) -> list[str]:
  """What ``out`` holds after a commit and nothing else: the files, .current, its directory."""
  current = (out / ".current").readlink().name
  return sorted([".current", current, *visible(out)])


def test_an_interrupted_run_leaves_the_last_output(tmp_path, given_tokenizer, monkeypatch):
  corpus = documents.Corpus.of(write_corpus(tmp_path / "corpus", "text"))
  out = tmp_path / "out"
  convert.convert(corpus, str(out), 0.2)
  before, listing = visible(out), sorted(p.name for p in out.iterdir())
  calls = []

  def interrupted(*args):
    if calls:
      raise KeyboardInterrupt
    calls.append(args)
    return tokenizers_lib.encode(*args)

  monkeypatch.setattr(convert, "BATCH", 200)
  monkeypatch.setattr(tokenizers_lib, "encode", interrupted)
  with pytest.raises(KeyboardInterrupt):
    convert.convert(corpus, str(out), 0.2, given_tokenizer)
  assert calls and visible(out) == before
  assert sorted(p.name for p in out.iterdir()) == listing  # Its staging directory removed.


# Converts into directories SERIES-k, k = 1, 2, ..., each in a forked child killed by SIGKILL
# at its k-th filesystem change, until one gets through; prints each series' exit codes.
KILLED_AT_EACH_CHANGE = r"""
import collections, json, os, signal, sys
from trainers import convert
from trainers.input import documents

def convert_killed_at(k, corpus, out, tokenizer):
  if os.fork():
    return os.waitstatus_to_exitcode(os.wait()[1])
  calls = [0]
  def killing(change):
    def counted(*args, **kwargs):
      calls[0] += 1
      if calls[0] == k:
        os.kill(os.getpid(), signal.SIGKILL)
      return change(*args, **kwargs)
    return counted
  for name in ("mkdir", "link", "symlink", "replace", "rename", "unlink", "remove", "rmdir"):
    setattr(os, name, killing(getattr(os, name)))
  sys.stderr = open(os.devnull, "w")
  try:
    convert.convert(corpus, out, 0.2, tokenizer)
  finally:
    os._exit(0 if calls[0] else 1)

corpus, tokenizer = documents.Corpus.of(sys.argv[1]), sys.argv[2]
codes = collections.defaultdict(list)
for out in sys.argv[3:]:
  series, k = out.rsplit("-", 1)
  if 0 not in codes[series]:
    codes[series].append(convert_killed_at(int(k), corpus, out, tokenizer))
print(json.dumps(list(codes.values())))
"""
EARLIER = ("committed", "plain")  # An output of this version; plain files, an earlier one's.
CHANGES = 30  # More than a conversion makes: 9 over a committed output, 25 over plain files.


def dead_pid() -> int:
  child = subprocess.Popen(["true"])
  child.wait()
  return child.pid


def make_plain(out) -> None:
  """``out`` as the earlier converter left it: plain files, and a killed run's temporary one."""
  for name, data in {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}.items():
    (out / name).unlink()
    (out / name).write_bytes(data)
  for hidden in out.glob(".*"):
    shutil.rmtree(hidden) if not hidden.is_symlink() else hidden.unlink()
  (out / f"train.bin.partial-{dead_pid()}").write_bytes(b"cut")


def test_a_kill_at_any_step_leaves_the_old_or_the_new_output_whole(
    tmp_path, capsys, given_tokenizer
):
  """A real SIGKILL at each filesystem change of a conversion (staging, the plain files'
  adoption, the commit, the clean-up) leaves the earlier output or the new one, whole; the
  next run removes what the killed one left, says so, and commits."""
  corpus_path = write_corpus(tmp_path / "corpus", "text")
  corpus = documents.Corpus.of(corpus_path)
  outs = {e: [tmp_path / f"{e}-{k:02}" for k in range(1, CHANGES + 1)] for e in EARLIER}
  for earlier, series in outs.items():
    for out in series:
      convert.convert(corpus, str(out), 0.2)  # The old output: bytes.
      if earlier == "plain":
        make_plain(out)
  old = visible(outs["committed"][0])
  convert.convert(corpus, str(tmp_path / "new"), 0.2, given_tokenizer)
  new = visible(tmp_path / "new")
  command = [sys.executable, "-c", KILLED_AT_EACH_CHANGE, corpus_path, given_tokenizer]
  every = [str(out) for series in outs.values() for out in series]
  done = subprocess.run(
      [*command, *every], cwd=ROOT, env=environment(), capture_output=True, timeout=120
  )
  assert done.returncode == 0, done.stderr[-3000:]
  codes = dict(zip(EARLIER, json.loads(done.stdout)))
  for earlier, series in outs.items():
    completed = len(codes[earlier]) - 1  # Killed at each change, until the last got through.
    assert codes[earlier] == [-signal.SIGKILL] * completed + [0]
    seen = []
    for out in series[: completed + 1]:
      seen.append("old" if visible(out) == old else "new" if visible(out) == new else "mixed")
      current = (out / ".current").readlink().name if (out / ".current").is_symlink() else None
      left = [p.name for p in out.glob(".convert-*") if p.name != current]
      left += [p.name for p in out.glob("*.partial-*")]
      capsys.readouterr()
      convert.convert(corpus, str(out), 0.2, given_tokenizer)  # The next run.
      err = capsys.readouterr().err
      assert visible(out) == new and sorted(p.name for p in out.iterdir()) == committed_listing(out)
      assert (f"removed what interrupted runs left in {out}: " in err) == bool(left), (left, err)
    assert seen[0] == "old" and seen[-1] == "new" and "mixed" not in seen, (earlier, seen)
    assert seen == sorted(seen, reverse=True)  # Old, then new: one step commits.
    assert completed == {"committed": 9, "plain": 25}[earlier]


def test_the_files_of_a_conversion_go_together(tmp_path, given_tokenizer):
  """A trained tokenizer is one of the committed files: a later run without one leaves no
  tokenizer.json, and a run given the directory's own keeps it."""
  corpus = documents.Corpus.of(write_corpus(tmp_path / "corpus", "text"))
  out = tmp_path / "out"
  convert.convert(corpus, str(out), 0.2, vocab_size=300)
  trained = visible(out)
  assert trained["train.bin.json"]["tokenizer"] == str(out / "tokenizer.json")
  convert.convert(corpus, str(out), 0.2, str(out / "tokenizer.json"))  # Its own tokenizer.
  assert visible(out) == trained
  convert.convert(corpus, str(out), 0.2)
  assert sorted(visible(out)) == ["train.bin", "train.bin.json", "val.bin", "val.bin.json"]
  assert sorted(p.name for p in out.iterdir()) == committed_listing(out)


@pytest.mark.parametrize(
    "args, line",
    [
        (
            ["{tmp}/nope", "{tmp}/out"],
            "ConfigError: the corpus argument: {tmp}/nope does not exist",
        ),
        (
            ["{tmp}/corpus", "{tmp}/corpus/a.txt"],
            "ConfigError: out_dir='{tmp}/corpus/a.txt' cannot",
        ),
        (
            ["{tmp}/corpus", "{tmp}/out", "--val_fraction=1.5"],
            "ConfigError: argument --val_fraction",
        ),
        (
            ["{tmp}/corpus", "{tmp}/out", "--val_fraction=0"],
            "ConfigError: argument --val_fraction: '0' is not a fraction strictly between 0 and 1",
        ),
        (
            ["{tmp}/corpus/a.txt", "{tmp}/out", "--val_fraction=1"],
            "ConfigError: argument --val_fraction: '1' is not a fraction strictly between 0 and 1",
        ),
        (
            ["{tmp}/corpus", "{tmp}/corpus/tokens"],
            "ConfigError: out_dir='{tmp}/corpus/tokens' is inside the corpus '{tmp}/corpus':",
        ),
        (["{tmp}/corpus"], "ConfigError: the following arguments are required: out_dir; see"),
        (["{tmp}/corpus", "{tmp}/out", "--dtype=int8"], "ConfigError: argument --dtype: invalid"),
        (["{tmp}/corpus/b.bin", "{tmp}/out"], "ConfigError: {tmp}/corpus/b.bin is not UTF-8 text;"),
        (
            ["{tmp}/corpus/c.jsonl", "{tmp}/out", "--text_field=body"],
            "ConfigError: {tmp}/corpus/c.jsonl:2 has no text field 'body' (its keys: ['text']);",
        ),
        (
            ["{tmp}/corpus/d.parquet", "{tmp}/out"],
            "ConfigError: {tmp}/corpus/d.parquet has no column 'text' (its columns: ['body', "
            "'n']);",
        ),
        (
            ["{tmp}/corpus/d.parquet", "{tmp}/out", "--text_field=n"],
            "ConfigError: {tmp}/corpus/d.parquet: column 'n' holds int64, not text;",
        ),
        (
            ["{tmp}/corpus", "{tmp}/out", "--train_tokenizer", "--vocab_size=4294967296"],
            "ConfigError: argument --vocab_size: '4294967296' is over 1048576, more ids than",
        ),
        (["{tmp}/corpus/e.txt", "{tmp}/out"], "ConfigError: the corpus (1 files) holds no text;"),
        (
            ["{tmp}/corpus/a.txt", "{tmp}/out", "--tokenizer={tmp}/corpus/a.txt"],
            "ConfigError: --tokenizer={tmp}/corpus/a.txt cannot be read as a Hugging Face",
        ),
        (
            ["{tmp}/corpus/a.txt", "{tmp}/out", "--train_tokenizer"],
            "ConfigError: --train_tokenizer needs --vocab_size=N",
        ),
        (
            ["{tmp}/corpus/c.jsonl", "{tmp}/out", "--train_tokenizer", "--vocab_size=300"],
            "ConfigError: {tmp}/corpus/c.jsonl:1 has no text field 'text' (its keys: ['body']);",
        ),
    ],
)
def test_bad_input_is_one_line_and_exit_1(tmp_path, capsys, args, line):
  corpus = tmp_path / "corpus"
  corpus.mkdir()
  (corpus / "a.txt").write_text("hello")
  (corpus / "b.bin").write_bytes(b"\xff\xfe\x00 not text")
  (corpus / "c.jsonl").write_text('{"body": "one"}\n{"text": "two"}\n')
  parquet.write_table(pa.table({"body": ["one"], "n": [1]}), corpus / "d.parquet")
  (corpus / "e.txt").write_text("")
  with pytest.raises(SystemExit) as exited:
    convert.main([a.format(tmp=tmp_path) for a in args])
  out = capsys.readouterr()
  assert exited.value.code == 1 and out.out == ""
  assert out.err.startswith(line.format(tmp=tmp_path)) and len(out.err.splitlines()) == 1, out.err
  written = [p for p in tmp_path.rglob("*") if p.is_file() and "corpus" not in p.parts]
  assert written == []  # Nothing written (a streaming error leaves at most an empty out_dir).


def test_help_shows_snake_case_flags_only(capsys):
  assert_snake_case_help(help_text(convert.main, capsys), "--val_fraction", "--dtype")
