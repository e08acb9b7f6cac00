"""Equal seconds: a run's steps from a budget in seconds, and when a curve reaches a loss.

Each optimizer trains for the same training seconds. The trainer stops on a step count, not
on a clock, so a run's ``config.total_steps`` comes from the optimizer's measured steps per
second (:func:`budget_steps`; step 1, which the curves leave out, comes on top), and so does
its eval period (:func:`eval_period`). :func:`check_one_epoch` refuses a budget whose run
would draw more tokens than its train slice holds, :func:`check_warmup` one that would end
within its warmup. :func:`reach_seconds` reads, from a
run's eval curve, the training seconds at which it first reaches a loss; :func:`verdict`
sets them against the baseline's seconds and the goal (``GOAL``, 0.8 of them).

Example:
  >>> budget_steps(1.43, 60), eval_period(1.43, 10)
  (85, 14)
  >>> curve = {"evals": {"14": 3.0, "28": 2.5, "42": 2.0}, "seconds": {"14": 10, "28": 20, "42": 30}}
  >>> reach_seconds(curve, 2.25), verdict(25.0, 50.0)
  (25.0, (0.5, True))
"""

import math

from trainers.errors import ConfigError

GOAL = 0.8  # A second-order optimizer's seconds to AdamW's final eval loss, over AdamW's.
HEADER = (
    "| split | run | seed | lr | steps | train s | start-up + compile s | eval s | final loss |"
)
TABLE = (
    "| run | seed | lr | final eval loss | train s | start-up + compile s | eval s "
    "| s to {base}'s final loss | ÷ {base}'s train s | ≤ {goal} |"
)


def budget_steps(steps_per_sec: float, seconds: float) -> int:
  """The timed steps that fill ``seconds`` at ``steps_per_sec`` (at least one); a run's
  ``config.total_steps`` is one more: its step 1 is not timed.

  Example:
    >>> budget_steps(1.43, 60), budget_steps(0.01, 60)
    (85, 1)
  """
  return max(1, math.floor(steps_per_sec * seconds))


def eval_period(steps_per_sec: float, every_seconds: float) -> int:
  """``config.eval_every``: the steps nearest ``every_seconds`` of training (at least one).

  Example:
    >>> eval_period(5.0, 10), eval_period(0.05, 10)
    (50, 1)
  """
  return max(1, round(steps_per_sec * every_seconds))


def probe_rate(records: list[dict]) -> float:
  """Steps per second of a short run's ``metrics.jsonl`` records, over its logged intervals
  after the first (which holds the warm-up after step 1).

  Example:
    >>> probe_rate([{"step": 1}, {"step": 10, "steps_per_sec": 1.0},
    ...             {"step": 20, "steps_per_sec": 2.0}, {"step": 30, "steps_per_sec": 4.0}])
    2.6666666666666665
  """
  intervals = list(zip(records, records[1:]))[1:]
  if not intervals:
    raise ValueError(f"{len(records)} records: a rate needs at least 3 logged steps")
  seconds = sum((r["step"] - p["step"]) / r["steps_per_sec"] for p, r in intervals)
  return (records[-1]["step"] - intervals[0][0]["step"]) / seconds


def check_one_epoch(
    run: str, steps: int, tokens_per_step: int, train_tokens: int, steps_per_sec: float, seconds
) -> None:
  """Raises unless ``steps`` steps of ``tokens_per_step`` fit in ``train_tokens``: a run at
  this budget would draw more windows than its train slice holds, so its data would repeat.

  Example:
    >>> check_one_epoch("adamw@1", 86, 32768, 3774874, 1.43, 60)  # 2.82M of 3.77M tokens
    >>> check_one_epoch("adamw@1", 86, 32768, 2**21, 1.43, 60)
    Traceback (most recent call last):
    ...
    bv_sharding.errors.ConfigError: --seconds 60: adamw@1 at 1.43 steps/s runs 86 steps of 32768 \
tokens, 2818048 tokens, more than the 2097152 tokens it trains on, so its batches would repeat; \
use --seconds 44 or less, or more data (--set="--config.input.max_tokens=0 \
--config.input.train=<more files>")
  """
  needed = steps * tokens_per_step
  if needed > train_tokens:
    most = math.floor((train_tokens // tokens_per_step - 1) / steps_per_sec)
    raise ConfigError(
        f"--seconds {seconds:g}: {run} at {steps_per_sec:.2f} steps/s runs {steps} steps of "
        f"{tokens_per_step} tokens, {needed} tokens, more than the {train_tokens} tokens it "
        f"trains on, so its batches would repeat; use --seconds {most} or less, or more data "
        '(--set="--config.input.max_tokens=0 --config.input.train=<more files>")'
    )


def check_warmup(run: str, steps: int, warmup: int, steps_per_sec: float, seconds) -> None:
  """Raises unless a run of ``steps`` steps gets past its schedule's ``warmup`` steps (the
  trainer refuses one that does not).

  Example:
    >>> check_warmup("shampoo@1", 16, 10, 0.26, 60)
    >>> check_warmup("shampoo@1", 6, 10, 0.26, 20)
    Traceback (most recent call last):
    ...
    bv_sharding.errors.ConfigError: --seconds 20: shampoo@1 at 0.26 steps/s runs 6 steps, not \
past its 10 warmup steps (config.schedule.warmup_steps); use --seconds 39 or more
  """
  if steps <= warmup:
    least = math.ceil(warmup / steps_per_sec)
    raise ConfigError(
        f"--seconds {seconds:g}: {run} at {steps_per_sec:.2f} steps/s runs {steps} steps, not "
        f"past its {warmup} warmup steps (config.schedule.warmup_steps); use --seconds {least} or "
        "more"
    )


def reach_seconds(curve: dict, target: float) -> float | None:
  """The training seconds at which ``curve`` (``lm_run.result``'s) first reaches ``target``:
  linear between the last eval above it and the first at or below it; the first eval's
  seconds if that one already is; None if no eval reaches it.

  Example:
    >>> curve = {"evals": {"10": 3.0, "20": 2.0}, "seconds": {"10": 5.0, "20": 10.0}}
    >>> reach_seconds(curve, 2.5), reach_seconds(curve, 3.5), reach_seconds(curve, 1.0)
    (7.5, 5.0, None)
  """
  points = sorted((curve["seconds"][step], loss) for step, loss in curve["evals"].items())
  before = None
  for seconds, loss in points:
    if loss <= target:
      if before is None:
        return seconds
      return before[0] + (seconds - before[0]) * (before[1] - target) / (before[1] - loss)
    before = (seconds, loss)
  return None


def final(curve: dict) -> tuple[float, float]:
  """(the last eval's loss, the training seconds up to it).

  Example:
    >>> final({"evals": {"9": 2.5, "10": 2.0}, "seconds": {"9": 4.0, "10": 5.0}})
    (2.0, 5.0)
  """
  last = max(curve["evals"], key=int)
  return curve["evals"][last], curve["seconds"][last]


def verdict(seconds: float | None, baseline_seconds: float) -> tuple[float | None, bool]:
  """(``seconds`` over the baseline's, whether that is at most ``GOAL``); None: never reached.

  Example:
    >>> verdict(45.0, 50.0), verdict(None, 50.0)
    ((0.9, False), (None, False))
  """
  if seconds is None:
    return None, False
  ratio = seconds / baseline_seconds
  return ratio, ratio <= GOAL


def spent(entry: dict) -> tuple[float, float, float]:
  """(training, start-up + compile, eval) seconds of a run's entry: the trainer's own
  training seconds; launch to its first logged step; first to last logged step less training.

  Example:
    >>> curve = {"evals": {"20": 2.0}, "seconds": {"20": 9.5}}
    >>> spent({"first": 30.0, "last": 42.0, "curve": curve})
    (9.5, 30.0, 2.5)
  """
  train = final(entry["curve"])[1]
  return train, entry["first"], max(0.0, entry["last"] - entry["first"] - train)


def row(entry: dict) -> str:
  """The printed row of a finished run (:data:`HEADER`'s columns).

  Example:
    >>> curve = {"evals": {"20": 2.0}, "seconds": {"20": 9.5}}
    >>> row(dict(split="eval", spec="adamw@1", seed=0, lr=3e-4, steps=20, first=30.0,
    ...          last=42.0, curve=curve))
    '| eval | adamw@1 | 0 | 0.0003 | 20 | 9.5 | 30.0 | 2.5 | 2.0000 |'
  """
  train, start, evals = spent(entry)
  loss = final(entry["curve"])[0]
  return (
      f"| {entry['split']} | {entry['spec']} | {entry['seed']} | {entry['lr']:g} | "
      f"{entry['steps']} | {train:.1f} | {start:.1f} | {evals:.1f} | {loss:.4f} |"
  )


def cell(value: float | None, form: str, missing: str) -> str:
  """``value`` in ``form``, or ``missing`` for None.

  Example:
    >>> cell(0.25, ".2f", "never"), cell(None, ".2f", "never")
    ('0.25', 'never')
  """
  return missing if value is None else format(value, form)


def table(runs: dict[str, list[dict]]) -> list[str]:
  """The comparison's markdown lines (:data:`TABLE`'s columns): a row per run and seed, each
  against the first run's entry of the same seed (the baseline).

  ``runs``: each run's entries, seed by seed, as :func:`row` reads them.
  """
  base, *_ = runs
  lines = [TABLE.format(base=base, goal=GOAL), "|---" * (TABLE.count("|") - 1) + "|"]
  for spec, entries in runs.items():
    for entry, baseline in zip(entries, runs[base]):
      target, base_seconds = final(baseline["curve"])
      train, start, evals = spent(entry)
      reached = reach_seconds(entry["curve"], target)
      ratio, met = verdict(reached, base_seconds)
      goal = "baseline" if spec == base else ("met" if met else "not met")
      lines.append(
          f"| {spec} | {entry['seed']} | {entry['lr']:g} | {final(entry['curve'])[0]:.4f} | "
          f"{train:.1f} | {start:.1f} | {evals:.1f} | {cell(reached, '.1f', 'not reached')} | "
          f"{cell(ratio, '.2f', 'n/a')} | {goal} |"
      )
  return lines
