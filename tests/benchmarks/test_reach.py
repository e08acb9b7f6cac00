"""Equal seconds' arithmetic: a budget's steps, one epoch at most, when a curve reaches a loss
and the table set against the baseline of the same seed."""

import math

import pytest

from benchmarks import reach
from trainers.errors import ConfigError


def curve(points: dict[int, tuple[float, float]]) -> dict:
  """``lm_run.result``'s form as JSON gives it back: {step: (seconds, loss)} by string step."""
  return {
      "evals": {str(step): loss for step, (_, loss) in points.items()},
      "seconds": {str(step): seconds for step, (seconds, _) in points.items()},
  }


def entry(spec: str, seed: int, points: dict, first: float = 30.0, last: float = 100.0) -> dict:
  return dict(spec=spec, seed=seed, lr=3e-4, split="eval", steps=max(points), first=first,
              last=last, curve=curve(points))  # fmt: skip


@pytest.mark.parametrize("rate,seconds", [(1.43, 60), (0.26, 60), (5.7, 45), (1000.0, 0.5)])
def test_the_budget_fills_the_seconds_and_no_more(rate, seconds):
  steps = reach.budget_steps(rate, seconds)
  assert steps / rate <= seconds < (steps + 1) / rate
  every = reach.eval_period(rate, 10)
  assert abs(every / rate - 10) <= 0.5 / rate


def test_a_budget_shorter_than_a_step_still_trains_and_evaluates_once():
  assert reach.budget_steps(0.01, 60) == 1 and reach.eval_period(0.01, 10) == 1


def test_the_probe_rate_leaves_out_the_warm_up_interval():
  records = [{"step": 1, "steps_per_sec": 0.01}, {"step": 10, "steps_per_sec": 0.5}]
  records += [{"step": s, "steps_per_sec": 2.0} for s in (20, 30)]
  assert reach.probe_rate(records) == 2.0
  with pytest.raises(ValueError, match="at least 3 logged steps"):
    reach.probe_rate(records[:2])


def test_one_epoch_is_the_most_a_run_draws_and_the_error_names_the_seconds_that_fit():
  tokens, per_step = 3_774_874, 2048 * 16  # The tune runs' train slice of the 4 MiB corpus.
  most = len(range(tokens // per_step)) - 1  # Timed steps that fit beside step 1.
  reach.check_one_epoch("adamw@1", 1 + most, per_step, tokens, 1.43, 80)
  with pytest.raises(ConfigError, match=r"--seconds 90: adamw@1 .* use --seconds 79 or less"):
    reach.check_one_epoch("adamw@1", 2 + most, per_step, tokens, 1.43, 90)
  assert math.floor(most / 1.43) == 79


def test_reach_is_linear_between_the_evals_around_the_target():
  c = curve({10: (5.0, 3.0), 20: (10.0, 2.0), 30: (15.0, 1.0), 40: (20.0, 1.5)})
  assert reach.reach_seconds(c, 2.5) == 7.5
  assert reach.reach_seconds(c, 2.0) == 10.0
  assert reach.reach_seconds(c, 1.2) == 14.0  # The first crossing; the later rise is not one.
  assert reach.reach_seconds(c, 9.0) == 5.0  # Already at the first eval.
  assert reach.reach_seconds(c, 0.5) is None


def test_the_table_pairs_each_run_with_the_baseline_of_its_seed():
  runs = {
      "adamw@1": [entry("adamw@1", 0, {10: (30.0, 3.0), 20: (60.0, 2.5)}),
                  entry("adamw@1", 1, {10: (30.0, 3.1), 20: (60.0, 2.7)})],
      "soap@1": [entry("soap@1", 0, {10: (30.0, 2.6), 20: (60.0, 2.1)}),
                 entry("soap@1", 1, {10: (30.0, 3.0), 20: (60.0, 2.8)})],
  }  # fmt: skip
  lines = reach.table(runs)
  assert lines[0].count("|") == lines[1].count("|") == lines[2].count("|") == 11
  assert "s to adamw@1's final loss" in lines[0] and "≤ 0.8" in lines[0]
  adamw0, adamw1, soap0, soap1 = lines[2:]
  assert adamw0.endswith("| 60.0 | 1.00 | baseline |") and "| 60.0 | 30.0 | 10.0 |" in adamw0
  # Seed 0: 2.6 at 30 s to 2.1 at 60 s crosses adamw's 2.5 at 30 + 30 * 0.1 / 0.5 = 36 s.
  assert soap0.startswith("| soap@1 | 0 | 0.0003 | 2.1000 |")
  assert soap0.endswith("| 36.0 | 0.60 | met |")
  assert soap1.endswith("| not reached | n/a | not met |")  # 2.8 never reaches seed 1's 2.7.


def test_a_run_past_the_goal_is_not_met():
  assert reach.verdict(41.0, 50.0) == (0.82, False)
  assert reach.verdict(40.0, 50.0) == (0.8, True)
