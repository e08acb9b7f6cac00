"""The accelerator benchmark's rows: the trainer and the plain loop timed alike, every column
a finite number (MFU None on CPU, whose peak is unknown); a failed row, a bad flag and the
shell script's fallback to PYTHONPATH."""

import math
import subprocess
import sys

import pytest

from benchmarks import accelerator
from tests.helpers import ROOT, assert_snake_case_help, environment, help_text

ONE_ROW = ("--optimizers", "adamw", "--dtypes", "float32", "--windows", "1", "--batch_size", "16")


def test_one_row_has_every_column_finite():
  config = accelerator.bench_config("tiny", "adamw", "float32", 1, batch_size=16)
  row = accelerator.measure(config, 1)
  assert set(row) == set(accelerator.COLUMNS) and accelerator.finite(row)
  assert row["mfu"] is None and row["formula_mfu"] is None
  assert all(row[c] > 0 for c in accelerator.COLUMNS if c not in ("mfu", "formula_mfu"))
  # Tokens per device: the trainer's steps/s times the global batch's tokens over 8 devices.
  assert math.isclose(row["tokens_per_sec"], row["steps_per_sec"] * 16 * 128 / 8)
  assert math.isclose(row["vs_plain"], row["steps_per_sec"] / row["plain_steps_per_sec"])
  line = accelerator.format_row("tiny", "adamw", "float32", row)
  assert line.count("|") == accelerator.HEADER.count("|") and "| n/a | n/a |" in line


def test_long_sequences_scan_and_rematerialise_the_layers():
  short = accelerator.bench_config("125m", "adamw", "bfloat16", 3)
  long = accelerator.bench_config("125m", "adamw", "bfloat16", 3, seq_len=2048, batch_size=16)
  assert (short.seq_len, short.model.scan_layers, short.model.remat) == (128, False, False)
  assert (long.seq_len, long.batch_size, long.model.scan_layers, long.model.remat) == (
      2048,
      16,
      True,
      True,
  )
  assert long.total_steps == 41 and long.log_every == 10 and long.eval_every > 41


def test_a_row_that_fails_says_why_in_one_line_and_the_table_goes_on(capsys):
  accelerator.main(["--sizes", "tiny", *ONE_ROW, "--batch_size", "12"])  # 12 rows on 8 devices
  lines = capsys.readouterr().out.splitlines()
  assert lines[2] == accelerator.HEADER and len(lines) == 5
  assert lines[4].startswith("| tiny | adamw | float32 | failed: ConfigError: ")


@pytest.mark.parametrize(
    "args,message",
    [
        (["--dtypes", "fp16"], "argument --dtypes: 'fp16': expected a comma-separated list of"),
        (["--sizes", "tiny,huge"], "argument --sizes: 'tiny,huge': expected"),
        (["--windows", "0"], "argument --windows: '0' is not an integer >= 1"),
        (["--seq_len", "-8"], "argument --seq_len: '-8' is not an integer >= 1"),
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
  flags = ("--sizes", "--optimizers", "--dtypes", "--windows", "--seq_len", "--batch_size")
  assert_snake_case_help(text, *flags, "--grad_accum_steps")


def test_the_script_runs_from_the_checkout_where_pip_cannot_install(tmp_path):
  python = tmp_path / "python"  # A python whose pip fails, as on a host without a registry.
  python.write_text(f'#!/bin/sh\n[ "$1 $2" = "-m pip" ] && exit 1\nexec "{sys.executable}" "$@"\n')
  python.chmod(0o755)
  env = environment(PYTHON=str(python), SIZES="tiny", BENCH_SECONDS="900")
  env.pop("PYTHONPATH", None)
  done = subprocess.run(
      ["bash", str(ROOT / "benchmarks" / "accelerator.sh"), *ONE_ROW],
      cwd=tmp_path,
      env=env,
      capture_output=True,
      text=True,
      timeout=240,
  )
  lines = done.stdout.splitlines()
  assert done.returncode == 0, done.stdout + done.stderr
  assert lines[0] == "BENCH_SECONDS=900 lowered to 540: one call ends within 9 minutes"
  assert lines[1].startswith("jax ") and "failed: running from the checkout" in lines[2]
  assert accelerator.HEADER in lines and lines[-1].startswith("| tiny | adamw | float32 | ")
  assert lines[-1].count("|") == accelerator.HEADER.count("|"), lines[-1]
