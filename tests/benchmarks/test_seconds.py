"""The equal-seconds mode of ``python -m benchmarks.quality``: a call stops between runs and
the next goes on from its results, a budget past one epoch stops before anything trains,
the lr grid picks each run's lowest tune loss, bad flags end as one line."""

import argparse
import json
import sys

import pytest

from benchmarks import quality, reach, seconds
from tests.helpers import assert_snake_case_help, help_text

SHAPE = ("--size", "tiny", "--seq_len", "64", "--batch_size", "16", "--dtype", "float32")
TINY = ("--seconds", "2", "--eval_seconds", "1", *SHAPE, "--seeds", "1", "--lrs", "3e-3")
WARMUP = "--set=--config.schedule.warmup_steps=2"  # A slow host's 2 s still get past it.
CORPUS = 4 * 2**20  # configs/lm.py's text: the standard library's first 4 MiB.


def test_a_call_stops_between_runs_and_the_next_goes_on_from_its_results(tmp_path, capsys):
  cache = ("--cache", str(tmp_path))
  quality.main([*TINY, WARMUP, *cache, "--runs", "adamw@1,muon@1", "--stop_after", "1"])
  assert "stopped: a probe of about" in capsys.readouterr().out  # After adamw's probe.
  (probe,) = seconds.load(tmp_path / "seconds.jsonl").values()
  assert probe["key"].startswith("probe adamw@1 ") and probe["tokens_per_step"] == 64 * 16
  assert probe["warmup"] == 2  # The run's own config, --set included.
  held_out = round(CORPUS * 0.05)  # The eval tail, and the tuning slice before it.
  assert probe["train_tokens"] == {"eval": CORPUS - held_out, "tune": CORPUS - 2 * held_out}

  moved = ("--results", str(tmp_path / "kept" / "seconds.jsonl"))  # As carried to a new host.
  (tmp_path / "kept").mkdir()
  (tmp_path / "seconds.jsonl").rename(moved[1])
  png = ("--png", str(tmp_path / "new" / "q.png"))  # Its folder is made.
  quality.main([*TINY, WARMUP, *cache, *moved, *png, "--runs", "adamw@1"])
  out = capsys.readouterr().out.splitlines()
  done = seconds.load(moved[1])
  (run,) = [entry for key, entry in done.items() if key.startswith("run ")]
  assert len(done) == 2  # The probe was not run again.
  assert run["steps"] == 1 + reach.budget_steps(probe["rate"], 2)
  every = reach.eval_period(probe["rate"], 1)
  assert sorted(map(int, run["curve"]["evals"])) == sorted(
      {*range(every, run["steps"] + 1, every), run["steps"]}
  )
  train, start, evals = reach.spent(run)
  assert train > 0 and start > 0 and evals >= 0 and run["wall"] > run["last"]
  assert reach.row(run) in out
  assert any(line.startswith("| adamw@1 | 0 | 0.003 |") and "baseline" in line for line in out)
  assert (tmp_path / "new" / "q.png").read_bytes()[:4] == b"\x89PNG"
  assert not any((tmp_path / "run").iterdir())  # Each run's workdir went with its line.


@pytest.mark.parametrize(
    "rate,message",
    [  # 60,001 steps of 1,024 tokens: more than the tune runs' 50M; 7 steps: within the warmup.
        (1000.0, "adamw@1 at 1000.00 steps/s runs 60001 steps of 1024 tokens, 61441024 tokens, "
         "more than the 50000000 tokens it trains on, so its batches would repeat; use --seconds "
         '48 or less, or more data (--set="--config.input.max_tokens=0 '
         '--config.input.train=<more files>")'),
        (0.1, "adamw@1 at 0.10 steps/s runs 7 steps, not past its 10 warmup steps "
         "(config.schedule.warmup_steps); use --seconds 100 or more"),
    ],
)  # fmt: skip
def test_a_budget_past_one_epoch_or_within_the_warmup_stops_before_anything_trains(
    rate, message, tmp_path, capsys
):
  shape = argparse.Namespace(size="tiny", seq_len=64, batch_size=16, dtype="float32", set="")
  probe = dict(key=f"probe adamw@1 {seconds.Sweep(shape, {}).setup}", wall=9.0, rate=rate)
  probe.update(first=5.0, warmup=10, tokens_per_step=1024)
  probe.update(train_tokens={"eval": 60_000_000, "tune": 50_000_000})
  (tmp_path / "seconds.jsonl").write_text(json.dumps(probe) + "\n")
  with pytest.raises(SystemExit) as exited:
    quality.main([*SHAPE, "--seconds", "60", "--lrs", "1e-3,3e-3", "--cache", str(tmp_path)])
  err = capsys.readouterr().err
  assert exited.value.code == 1 and err == f"ConfigError: --seconds 60: {message}\n"
  assert len(seconds.load(tmp_path / "seconds.jsonl")) == 1 and not (tmp_path / "run").exists()


class Grid(seconds.Sweep):
  """A sweep whose runs end at a loss set by their lr: lowest at 1e-3 for adamw, 3e-3 for
  muon."""

  def train(self, spec: str, split: str, seed: int, lr: float) -> dict:
    self.asked.append((spec, split, seed, lr))
    loss = abs(lr - {"adamw@1": 1e-3, "muon@1": 3e-3}[spec]) + 2
    points = {"evals": {"10": loss}, "seconds": {"10": 5.0}}
    return dict(split=split, spec=spec, seed=seed, lr=lr, steps=10, first=1.0, last=7.0,
                curve=points)  # fmt: skip


def test_the_grid_runs_every_lr_on_the_tune_split_and_keeps_each_runs_lowest(capsys):
  grid = Grid(argparse.Namespace(lrs=[3e-4, 1e-3, 3e-3]), {})
  grid.asked = []
  assert seconds.tune(grid, ["adamw@1", "muon@1"]) == {"adamw@1": 1e-3, "muon@1": 3e-3}
  assert {(split, seed) for _, split, seed, _ in grid.asked} == {("tune", seconds.TUNE_SEED)}
  assert len(grid.asked) == 6 and len(capsys.readouterr().out.splitlines()) == 6


def test_without_matplotlib_the_table_says_how_to_draw_the_png_later(monkeypatch, tmp_path):
  monkeypatch.setitem(sys.modules, "matplotlib", None)  # Its import fails.
  run = dict(seed=0, curve={"evals": {"10": 2.0}, "seconds": {"10": 5.0}})
  line = seconds.plot({"adamw@1": [run]}, str(tmp_path / "q.png"), "tiny")
  assert line.startswith("no PNG: matplotlib is not installed") and "--results" in line
  assert not (tmp_path / "q.png").exists()


@pytest.mark.parametrize(
    "args,message",
    [
        (["--seconds", "0"], "argument --seconds: '0' is not a number > 0"),
        (["--seconds", "60", "--lrs", "3e-4,x"], "argument --lrs: 'x' is not a learning rate > 0"),
        (["--seconds", "60", "--dtype", "fp16"], "argument --dtype: invalid choice: 'fp16'"),
    ],
)
def test_a_bad_flag_ends_as_one_line(args, message, capsys):
  with pytest.raises(SystemExit) as exited:
    quality.main(args)
  assert exited.value.code == 1 and message in capsys.readouterr().err


def test_help_names_the_flags(capsys):
  text = help_text(quality.main, capsys)
  assert_snake_case_help(text, "--seconds", "--eval_seconds", "--lrs", "--stop_after", "--png")
