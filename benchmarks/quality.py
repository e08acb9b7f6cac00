"""Quality: eval loss of each optimizer over seeds, at fixed steps and at equal wall-clock.

Trains configs/lm.py through ``python -m trainers.train`` once per (optimizer, device count,
seed): adamw, muon, kron, shampoo and soap (their default blocks, the param's fixed tiles) on 8
simulated devices, and Kron's and Shampoo's shard-local blocks ("kron:local",
"shampoo:local") on 1 and 8 devices. A run is ``<optimizer>[:local][:<key>=<value>...]@<devices>``:
each ``key=value`` is a config override of that run (``muon:optax.consistent_rms=0.4@8``,
``shampoo:lr=0.0015@8``), for comparing candidate hyperparameters. ``--split tune``
evaluates the tuning slice (``config.input.tune_fraction``: the 5% of the corpus before the
eval split, held out of training) instead of the eval split, for choosing defaults on data
the reported eval loss never sees. Each run's workdir and result (``result.json``: its
eval losses and the training seconds up to each) stay under ``--cache``, one per run and
split: a later call skips finished runs and the trainer resumes unfinished ones from their
checkpoints, so the sweep can run in parts. The table gives, per run, mean ± std over the
seeds of the eval loss at each eval step, of its difference at the last step from the first
run of ``--runs`` paired by seed (:func:`paired`), and of the eval loss at the wall-clock
every run reached (the shortest run's training time; the first step, which compiles, not
counted).

  python -m benchmarks.quality [--seeds 3] [--runs adamw@8,kron:local@1] [--cache runs/quality] \
      [--split eval|tune] [--eval_every 100] [--set="--config.total_steps=20 ..."]

``--seconds S`` is the equal-seconds mode instead (benchmarks/seconds.py): every run trains
for S seconds of its own speed on the device, its lr tuned within ``--lrs`` first, and the
table says how soon each reaches the first run's final eval loss.
"""

import json
import pathlib
import statistics
import subprocess

from benchmarks import lm_run, seconds
from trainers.settings import cli

RUNS = (
    "adamw@8",
    "muon@8",
    "kron@8",
    "shampoo@8",
    "soap@8",
    "kron:local@1",
    "kron:local@8",
    "shampoo:local@1",
    "shampoo:local@8",
)


def run(cache: pathlib.Path, spec: str, seed: int, extra, split: str = "eval") -> dict:
  """One run's :func:`lm_run.result` on ``split``, trained now unless ``cache`` holds it."""
  optimizer, _, devices = spec.partition("@")
  tune = split == "tune"
  workdir = cache / f"{optimizer.replace(':', '-')}-d{devices}-s{seed}{'-tune' * tune}"
  extra = [*extra, f"--config.input.tune_fraction={lm_run.TUNE_FRACTION}"] if tune else extra
  done = workdir / "result.json"
  if done.exists():
    return json.loads(done.read_text())
  flags = lm_run.flags(optimizer, int(devices), seed, extra)
  subprocess.run([*lm_run.command(workdir), *flags], check=True)
  out = lm_run.result(lm_run.records(workdir))
  done.write_text(json.dumps(out))
  return json.loads(done.read_text())  # Step keys as JSON has them, as when cached.


def mean_std(values: list[float | None]) -> str:
  """Mean ± std of the values there are; a run without one (``None``) is counted as missing.

  Example:
    >>> mean_std([1.0, 2.0, None])
    '1.500 ± 0.707 (2 of 3 runs)'
  """
  there = [v for v in values if v is not None]
  if not there:
    return "no eval yet"
  std = statistics.stdev(there) if len(there) > 1 else 0.0
  missing = f" ({len(there)} of {len(values)} runs)" if len(there) < len(values) else ""
  return f"{statistics.fmean(there):.3f} ± {std:.3f}{missing}"


def paired(runs: list[dict], base: list[dict], step: str) -> list[float]:
  """Each run's eval loss at ``step`` minus that of the ``base`` run of the same seed.

  Runs of one seed share the init, the batches and the evaluated windows, so the difference is
  the optimizer's, with less of the seed's noise than the two means' difference.

  Example:
    >>> paired([{"evals": {"3": 1.5}}], [{"evals": {"3": 1.75}}], "3")
    [-0.25]
  """
  return [r["evals"][step] - b["evals"][step] for r, b in zip(runs, base)]


def loss_at(res: dict, seconds: float) -> float | None:
  """The eval loss of the last eval at most ``seconds`` into training (None before the first)."""
  reached = [s for s, t in res["seconds"].items() if t <= seconds + 1e-9]
  return res["evals"][max(reached, key=int)] if reached else None


@cli.command
def main(argv=None):
  parser = cli.Parser("python -m benchmarks.quality", __doc__)
  parser.add_argument("--seeds", type=int, default=3)
  parser.add_argument(
      "--runs",
      help=f"<optimizer>@<devices>,... (default {','.join(RUNS)}; --seconds: "
      f"{','.join(seconds.RUNS)}); the first is the baseline",
  )
  parser.add_argument("--cache", default="runs/quality")
  parser.add_argument(
      "--split", default="eval", choices=("eval", "tune"), help="the held-out slice evaluated"
  )
  parser.add_argument("--eval_every", type=int, default=100)
  parser.add_argument("--set", default="", help="trainer flags for every run, space-separated")
  seconds.add_flags(parser)
  args = parser.parse_args(argv)
  if args.seconds:
    return seconds.sweep(args)
  cache = pathlib.Path(args.cache)
  cache.mkdir(parents=True, exist_ok=True)
  specs = (args.runs or ",".join(RUNS)).split(",")
  extra = [*args.set.split(), f"--config.eval_every={args.eval_every}"]
  results = {
      s: [run(cache, s, seed, extra, args.split) for seed in range(args.seeds)] for s in specs
  }
  steps = sorted({k for rs in results.values() for r in rs for k in r["evals"]}, key=int)
  clock = min(max(r["seconds"].values()) for rs in results.values() for r in rs)
  head = " | ".join(f"eval @ {s}" for s in steps)
  print(f"| optimizer | devices | {head} | Δ @ {steps[-1]} vs {specs[0]} | eval @ {clock:.0f} s |")
  print("|---|---|" + "---|" * (len(steps) + 2))
  for spec, rs in results.items():
    optimizer, _, devices = spec.partition("@")
    at_steps = " | ".join(mean_std([r["evals"][s] for r in rs]) for s in steps)
    delta = mean_std(paired(rs, results[specs[0]], steps[-1]))
    at_clock = mean_std([loss_at(r, clock) for r in rs])
    print(f"| {optimizer} | {devices} | {at_steps} | {delta} | {at_clock} |")


if __name__ == "__main__":
  main()
