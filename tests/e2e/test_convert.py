"""`python -m trainers.convert TEXT OUT_DIR`, in process: a text corpus streamed into token files,
and each bad input one line, exit status 1, before anything is written.
"""

import json

import numpy as np
import pytest

from tests.helpers import assert_snake_case_help, help_text
from trainers import convert
from trainers.input import sources


def test_convert_streams_text_into_token_files(tmp_path, capsys, monkeypatch):
  monkeypatch.setattr(convert, "CHUNK", 100)  # Many chunks, and a cut inside one.
  corpus = tmp_path / "corpus"
  corpus.mkdir()
  texts = ["ünïcode text, first file. " * 30, "second file. " * 40]
  for i, text in enumerate(texts):
    (corpus / f"{i}.txt").write_text(text)
  raw = b"".join(t.encode() for t in texts)
  convert.main([str(corpus), str(tmp_path / "out"), "--val_fraction=0.1", "--dtype=uint16"])
  out = capsys.readouterr()
  assert out.err.splitlines()[-1].startswith("converted 0.0 / 0.0 MiB (100%), ")
  assert "configs/lm_data.py:train=" in out.out
  cut = len(raw) - round(len(raw) * 0.1)
  train = np.fromfile(tmp_path / "out" / "train.bin", np.uint16)
  val = np.fromfile(tmp_path / "out" / "val.bin", np.uint16)
  np.testing.assert_array_equal(np.concatenate([train, val]), np.frombuffer(raw, np.uint8))
  assert len(train) == cut
  record = json.loads((tmp_path / "out" / "train.bin.json").read_text())
  assert record == {"dtype": "uint16", "tokens": cut, "max_token": int(max(raw[:cut]))}
  written = sources.input_config(kind="tokens", train=str(tmp_path / "out"))
  whole = sources.token_stream(sources.input_spec(written), "train")
  assert [n.rsplit("/", 1)[1] for n in whole.names] == ["train.bin", "val.bin"]  # No .json.


@pytest.mark.parametrize(
    "args, line",
    [
        (["{tmp}/nope", "{tmp}/out"], "ConfigError: the text argument: {tmp}/nope does not exist"),
        (
            ["{tmp}/corpus", "{tmp}/corpus/a.txt"],
            "ConfigError: out_dir='{tmp}/corpus/a.txt' cannot",
        ),
        (
            ["{tmp}/corpus", "{tmp}/out", "--val_fraction=1.5"],
            "ConfigError: argument --val_fraction",
        ),
        (["{tmp}/corpus"], "ConfigError: the following arguments are required: out_dir; see"),
        (["{tmp}/corpus", "{tmp}/out", "--dtype=int8"], "ConfigError: argument --dtype: invalid"),
    ],
)
def test_bad_input_is_one_line_and_exit_1(tmp_path, capsys, args, line):
  (tmp_path / "corpus").mkdir()
  (tmp_path / "corpus" / "a.txt").write_text("hello")
  with pytest.raises(SystemExit) as exited:
    convert.main([a.format(tmp=tmp_path) for a in args])
  out = capsys.readouterr()
  assert exited.value.code == 1 and out.out == ""
  assert out.err.startswith(line.format(tmp=tmp_path)) and len(out.err.splitlines()) == 1, out.err
  assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus"]  # Nothing written.


def test_help_shows_snake_case_flags_only(capsys):
  assert_snake_case_help(help_text(convert.main, capsys), "--val_fraction", "--dtype")
