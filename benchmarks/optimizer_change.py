"""Optimizer changes on resume: the loss jump of every ordered pair of the registry's optimizers.

Trains configs/lm.py's one-layer tiny Llama (the trainer tests' run: batch 16 of 32 tokens, 2
warmup steps, then a constant lr) for ``--steps`` (30) steps with each optimizer A through
``python -m trainers.train``, once, then resumes a copy of that workdir with
``--config.optax_name=B`` for ``--after`` (5) steps, for every B (B = A: the control, its state
kept as saved). The jump (:func:`jump`): the highest train loss of the steps after the change
minus the mean of the ``--after`` steps before it; every run sees the same batches, so the
control's jump is the batches' own. A resume that fails is shown as ``crash``. ``--set`` adds
trainer flags to every resume (``--set=--config.rewarmup_steps=0``: without the ramp).
Workdirs stay under ``--cache``, one per source and per resume and ``--set``; a later call
skips finished ones.

  python -m benchmarks.optimizer_change [--optimizers adamw,kron] [--to adamw] [--jobs 1] \
      [--steps 30] [--after 5] [--cache runs/optimizer_change] [--set="--config.rewarmup_steps=0"]
"""

import argparse
import concurrent.futures
import hashlib
import json
import pathlib
import shutil
import subprocess
import sys

from trainers.optimizers import registry

CONFIG = "configs/lm.py:layers=1"
RUN = (
    "--config.batch_size=16",
    "--config.seq_len=32",
    "--config.log_every=1",
    "--config.eval_every=1000",
    "--config.eval_batches=1",
    "--config.schedule.warmup_steps=2",
    "--config.schedule.decay_type=stair",  # Constant after the warmup, whatever total_steps.
)


def jump(losses: list[float], at: int, after: int) -> float:
  """The highest of ``losses`` (one a step, from step 1) at steps ``at + 1 .. at + after``
  minus the mean of the ``after`` steps up to ``at``.

  Example:
    >>> jump([3.0, 2.0, 2.0, 2.5, 1.0], at=3, after=2)
    0.5
  """
  before = losses[at - after : at]
  return max(losses[at : at + after]) - sum(before) / len(before)


def train(workdir: pathlib.Path, total: int, *flags: str) -> bool:
  """Runs the trainer in ``workdir`` up to step ``total``; whether it ended well (its output in
  ``workdir``'s ``.log`` beside it)."""
  cmd = [sys.executable, "-m", "trainers.train", f"--workdir={workdir}", f"--config={CONFIG}"]
  cmd += [*RUN, f"--config.total_steps={total}", f"--config.ckpt_steps={total}", *flags]
  with open(workdir.with_suffix(".log"), "a") as log:
    return subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, check=False).returncode == 0


def losses(workdir: pathlib.Path) -> list[float]:
  """The train loss of each step in ``workdir``'s metrics.jsonl, the last record of a step kept."""
  records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  by_step = {r["step"]: r["loss"] for r in records}
  return [by_step[step] for step in sorted(by_step)]


def source(cache: pathlib.Path, name: str, steps: int) -> pathlib.Path:
  """The workdir of ``steps`` steps of ``name``, trained once."""
  workdir = cache / f"{name}-{steps}"
  if not (workdir / "done").exists():
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    if not train(workdir, steps, f"--config.optax_name={name}"):
      raise RuntimeError(f"{name}'s first {steps} steps failed: see {workdir}.log")
    (workdir / "done").touch()
  return workdir


def changed(start: pathlib.Path, name: str, steps: int, after: int, flags: list) -> float | None:
  """The :func:`jump` of ``start`` (a :func:`source` workdir) resumed with ``name`` for
  ``after`` steps and ``flags``; None: the resume failed. Made once per ``flags``."""
  tag = hashlib.sha1(" ".join(flags).encode()).hexdigest()[:8]
  workdir = start.parent / f"{start.name}-to-{name}-{after}-{tag}"
  result = workdir / "jump.json"
  if not result.exists():
    shutil.rmtree(workdir, ignore_errors=True)
    shutil.copytree(start, workdir)
    ok = train(workdir, steps + after, f"--config.optax_name={name}", *flags)
    result.write_text(json.dumps(jump(losses(workdir), steps, after) if ok else None))
  return json.loads(result.read_text())


def table(jumps: dict, sources: list[str], targets: list[str]) -> str:
  """``jumps`` (``{(A, B): jump or None}``) as rows A, columns B (``crash`` for None).

  Example:
    >>> print(table({("adamw", "kron"): 0.123, ("kron", "kron"): None}, ["adamw", "kron"], ["kron"]))
    from \\ to               kron
    adamw                 +0.123
    kron                   crash
  """
  cell = lambda j: "crash" if j is None else f"{j:+.3f}"
  lines = ["from \\ to".ljust(14) + "".join(f"{b:>14}" for b in targets)]
  for a in sources:
    cells = "".join(f"{cell(jumps[a, b]):>14}" for b in targets if (a, b) in jumps)
    lines.append(f"{a:<14}{cells}")
  return "\n".join(lines)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--optimizers", default=",".join(registry.OPTIMIZERS), help="sources A")
  parser.add_argument("--to", default=",".join(registry.OPTIMIZERS), help="targets B")
  parser.add_argument("--steps", type=int, default=30, help="steps of A before the change")
  parser.add_argument("--after", type=int, default=5, help="steps of B after it")
  parser.add_argument("--jobs", type=int, default=1, help="trainer runs at a time")
  parser.add_argument("--cache", default="runs/optimizer_change")
  parser.add_argument("--set", default="", help="trainer flags of every resume")
  args = parser.parse_args(argv)
  sources, targets = args.optimizers.split(","), args.to.split(",")
  cache, flags = pathlib.Path(args.cache), args.set.split()
  with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
    starts = dict(zip(sources, pool.map(lambda a: source(cache, a, args.steps), sources)))
    pairs = [(a, b) for a in sources for b in targets]
    run = lambda pair: changed(starts[pair[0]], pair[1], args.steps, args.after, flags)
    jumps = dict(zip(pairs, pool.map(run, pairs)))
  print(
      f"loss jump: max of steps {args.steps + 1}-{args.steps + args.after} - mean of steps "
      f"{args.steps - args.after + 1}-{args.steps}; resumes with {flags or 'no extra flags'}"
  )
  print(table(jumps, sources, targets))


if __name__ == "__main__":
  main()
