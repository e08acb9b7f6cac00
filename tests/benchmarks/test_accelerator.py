"""The accelerator benchmark's row: the trainer's compiled step in both loops, every column a
finite number (MFU None on CPU, whose peak is unknown)."""

import math

from benchmarks import accelerator


def test_one_row_has_every_column_finite():
  row = accelerator.measure(accelerator.bench_config("tiny", "adamw", "float32", 3), 3)
  assert set(row) == set(accelerator.COLUMNS)
  assert row["mfu"] is None and accelerator.finite(row)
  assert all(row[c] > 0 for c in accelerator.COLUMNS if c != "mfu")
  # Tokens per device: the loop's steps/s times the global batch's tokens over 8 devices.
  assert math.isclose(row["tokens_per_sec"], row["steps_per_sec"] * 16 * 128 / 8)
  line = accelerator.format_row("tiny", "adamw", "float32", row)
  assert line.count("|") == accelerator.HEADER.count("|") and "| n/a |" in line
