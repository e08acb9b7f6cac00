"""The accelerator benchmark's row: the trainer's compiled step in both loops, every column a
finite number (MFU None on CPU, whose peak is unknown)."""

import math

import pytest

from benchmarks import accelerator
from tests.helpers import assert_snake_case_help, help_text


def test_one_row_has_every_column_finite():
  row = accelerator.measure(accelerator.bench_config("tiny", "adamw", "float32", 3), 3)
  assert set(row) == set(accelerator.COLUMNS)
  assert row["mfu"] is None and row["compiled_gib"] is not None and accelerator.finite(row)
  assert all(row[c] > 0 for c in accelerator.COLUMNS if c != "mfu")
  # Tokens per device: the loop's steps/s times the global batch's tokens over 8 devices.
  assert math.isclose(row["tokens_per_sec"], row["steps_per_sec"] * 16 * 128 / 8)
  line = accelerator.format_row("tiny", "adamw", "float32", row)
  assert line.count("|") == accelerator.HEADER.count("|") and "| n/a |" in line


@pytest.mark.parametrize(
    "args,message",
    [
        (["--dtypes", "fp16"], "argument --dtypes: 'fp16': expected a comma-separated list of"),
        (["--sizes", "tiny,huge"], "argument --sizes: 'tiny,huge': expected"),
        (["--steps", "0"], "--steps 0 --repeats 2: each must be at least 1"),
    ],
)
def test_bad_flag_ends_as_one_line_before_anything_runs(args, message, capsys):
  with pytest.raises(SystemExit) as exited:
    accelerator.main(args)
  out = capsys.readouterr()
  assert exited.value.code == 1 and out.out == ""
  assert out.err.startswith("ConfigError: ") and message in out.err


def test_help_names_the_flags(capsys):
  text = help_text(accelerator.main, capsys)
  assert_snake_case_help(text, "--sizes", "--optimizers", "--dtypes", "--steps", "--repeats")
