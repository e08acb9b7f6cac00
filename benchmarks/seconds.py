r"""Quality per second: every optimizer trains for the same seconds; how soon each reaches
AdamW's final eval loss.

  python -m benchmarks.quality --seconds 60 --eval_seconds 10 --lrs 3e-4,1e-3 --seeds 2 \
      [--runs adamw@1,muon@1,kron@1,shampoo@1,soap@1] [--size 125m --seq_len 2048 \
      --batch_size 16 --dtype bfloat16] [--cache runs/quality] [--results F.jsonl] [--png F.png] \
      [--stop_after 480] [--split eval|tune] [--set="--config.<key>=<value> ..."]

The protocol, for configs/lm.py:size=125m at seq 2048 x 16 (``--dtype``: ``DTYPES`` of
benchmarks/accelerator.py, layers scanned and rematerialised from seq 1024 on, as there):

1. **Probe.** The trainer stops on a step count, so each run first gets a 30-step run
   (:func:`probe`); its steps/s after step 10 (``reach.probe_rate``) fixes every later run
   of that optimizer: ``total_steps`` = 1 + ``reach.budget_steps(rate, --seconds)``, so the
   cosine schedule ends where the budget does, and ``eval_every`` = ``log_every`` =
   ``reach.eval_period(rate, --eval_seconds)``. A run's training seconds are the trainer's
   own (its ``steps_per_sec`` records: compile, step 1 and the evals left out), so they land
   near ``--seconds``, not on it; the table gives each run's.
2. **One epoch at most.** A run draws (total_steps x batch x seq) tokens of random windows of
   its train slice: 4 MiB of text, less the 5% eval tail, is 3,984,589 tokens (3,774,874 less
   the 5% tuning slice as well). At 2048 x 16 = 32,768 tokens a step that is 115 steps (tune
   runs); AdamW's 1.43 steps/s there (docs/hardware.md) fills 60 s with 85 + 1 steps, 2.8M
   tokens: 0.75 of an epoch. The bound is tokens/s x seconds, whatever the shape: a shorter
   sequence runs more steps of fewer tokens in the same seconds and does not stretch it (at
   ~47k tokens/s the corpus lasts ~80 s). ``reach.check_one_epoch`` refuses a longer budget
   before anything trains; ``--set="--config.input.kind=tokens --config.input.train=..."``
   trains on more data.
3. **Tune.** With more than one lr in ``--lrs`` (or ``--split tune``), every lr of that grid
   (``config.lr``; each optimizer scales it as its registry entry does) trains seed 0 on the
   tuning split (``config.input.tune_fraction`` = 0.05, evaluating that slice); the lr of the
   lowest final tune loss is each optimizer's. ``--split tune`` stops there.
4. **Eval.** Each optimizer at its lr, seeds 0..``--seeds``-1 (seed by seed), on the eval
   split. The table gives, per optimizer and seed, the final eval loss, the seconds spent
   training, starting (start-up, compile, init and step 1) and evaluating, and the seconds
   at which the run first reaches the first run's (AdamW's) final eval loss of the same seed,
   over AdamW's training seconds: the goal is at most ``reach.GOAL`` (0.8). A PNG of eval loss
   against training seconds goes beside the results (matplotlib: the ``plot`` extra).

Every probe and run is one line of ``--results`` (default ``<cache>/seconds.jsonl``), written
as it ends and printed as a row; a later call skips those, so a sweep runs in parts. A run's
workdir (``<cache>/<run>``) is removed once its line is written. ``--stop_after S`` starts no
run that would not end within S seconds of the call's start (estimated from the longest run
so far), so a time-limited call ends between runs.
"""

import argparse
import dataclasses
import json
import pathlib
import shutil
import time

from benchmarks import accelerator, lm_run, reach
from trainers.input import sources
from trainers.models import llama
from trainers.settings import cli

RUNS = ("adamw@1", "muon@1", "kron@1", "shampoo@1", "soap@1")
PROBE_EVERY = 10  # The probe logs every 10 steps; its rate leaves out the first 10.
PROBE_STEPS = 3 * PROBE_EVERY
TUNE_SEED = 0
NEVER = 10**9  # config.ckpt_steps: the trainer saves only at the end.


def add_flags(parser: cli.Parser) -> None:
  """The flags of the equal-seconds mode (``--seconds``) of ``python -m benchmarks.quality``."""
  positive = cli.number_in(lambda v: v > 0, "a number > 0")
  parser.add_argument("--seconds", type=positive, help="equal training seconds per run")
  parser.add_argument("--eval_seconds", type=positive, default=10.0, help="seconds between evals")
  parser.add_argument("--lrs", type=lr_grid, default="3e-4", help="config.lr grid, e.g. 3e-4,1e-3")
  parser.add_argument("--size", choices=sorted(llama.PRESETS), default="125m")
  parser.add_argument("--seq_len", type=cli.at_least(1), default=2048)
  parser.add_argument("--batch_size", type=cli.at_least(1), default=16)
  parser.add_argument("--dtype", choices=sorted(accelerator.DTYPES), default="bfloat16")
  parser.add_argument("--results", default=None, help="default: <cache>/seconds.jsonl")
  parser.add_argument("--png", default=None, help="default: <cache>/seconds.png")
  parser.add_argument("--stop_after", type=positive, default=None, help="this call's seconds")


def lr_grid(text: str) -> list[float]:
  """An argparse ``type``: comma-separated learning rates, each > 0.

  Example:
    >>> lr_grid("3e-4,1e-3")
    [0.0003, 0.001]
  """
  return [cli.number_in(lambda v: v > 0, "a learning rate > 0")(lr) for lr in text.split(",")]


def shape_flags(args) -> list[str]:
  """The trainer's flags for the model's shape and dtypes, beside ``--config``'s size.

  Example:
    >>> shape_flags(argparse.Namespace(seq_len=2048, batch_size=16, dtype="float32"))
    ['--config.seq_len=2048', '--config.batch_size=16', '--config.model.scan_layers=True', \
'--config.model.remat=True']
  """
  out = [f"--config.seq_len={args.seq_len}", f"--config.batch_size={args.batch_size}"]
  out += [f"--config.{key}={value}" for key, value in accelerator.DTYPES[args.dtype].items()]
  if args.seq_len >= accelerator.LONG_SEQ:
    out += ["--config.model.scan_layers=True", "--config.model.remat=True"]
  return out


def train_tokens(config: dict) -> dict[str, int]:
  """Tokens of the train slice of an eval run and of a tune run, of a run's ``config.json``."""
  sizes = {}
  for split, tune in (("eval", 0.0), ("tune", lm_run.TUNE_FRACTION)):
    spec = sources.input_spec({**config["input"], "tune_fraction": tune})
    sizes[split] = len(sources.token_slices(spec)["train"])
  return sizes


class CallEnds(Exception):
  """The next run would not end within ``--stop_after``."""


@dataclasses.dataclass
class Sweep:
  """The runs of one call: ``args`` (the command's flags), ``done`` (``--results``' lines by
  key) and the clock of the call."""

  args: argparse.Namespace
  done: dict
  begun: float = dataclasses.field(default_factory=time.perf_counter)

  @property
  def setup(self) -> str:
    return " ".join([f"size={self.args.size}", *shape_flags(self.args), *self.args.set.split()])

  def probe(self, spec: str) -> dict:
    """``spec``'s steps/s at this shape, its tokens a step and its train slices' tokens."""
    key = f"probe {spec} {self.setup}"
    if key not in self.done:
      steps = [f"--config.total_steps={PROBE_STEPS}", f"--config.log_every={PROBE_EVERY}"]
      entry, records, config = self.launch(key, spec, "eval", 0, self.args.lrs[0], steps)
      entry.update(rate=reach.probe_rate(records), train_tokens=train_tokens(config))
      entry["tokens_per_step"] = config["batch_size"] * config["seq_len"]
      entry["warmup"] = config["schedule"].get("warmup_steps", 0)
      self.keep(entry)
    return self.done[key]

  def train(self, spec: str, split: str, seed: int, lr: float) -> dict:
    """One run of ``spec`` on ``split`` within the budget, its ``lm_run.result`` as
    ``"curve"``; from ``--results`` when it holds it."""
    args = self.args
    timing = f"seconds={args.seconds:g} every={args.eval_seconds:g}"
    key = f"run {spec} {split} seed={seed} lr={lr:g} {timing} {self.setup}"
    if key not in self.done:
      rate = self.probe(spec)["rate"]
      every = reach.eval_period(rate, args.eval_seconds)
      steps = 1 + reach.budget_steps(rate, args.seconds)
      plan = [f"--config.total_steps={steps}", f"--config.eval_every={every}"]
      entry, _, _ = self.launch(key, spec, split, seed, lr, [*plan, f"--config.log_every={every}"])
      self.keep(entry)
    return self.done[key]

  def launch(self, key: str, spec: str, split: str, seed: int, lr: float, steps: list[str]):
    """(the entry, the records, the config) of one trainer run, once it fits the call."""
    self.check_time("probe" if key.startswith("probe") else "run")
    optimizer, _, devices = spec.partition("@")
    tune = [f"--config.input.tune_fraction={lm_run.TUNE_FRACTION}"] if split == "tune" else []
    extra = [*shape_flags(self.args), *self.args.set.split(), f"--config.lr={lr:g}", *tune]
    extra += [*steps, f"--config.ckpt_steps={NEVER}", "--nodistributed_auto"]
    workdir = pathlib.Path(self.args.cache) / key.split()[0] / f"{spec.replace(':', '-')}-s{seed}"
    shutil.rmtree(workdir, ignore_errors=True)  # An unfinished run starts again.
    workdir.mkdir(parents=True)
    cmd = lm_run.command(workdir, f"configs/lm.py:size={self.args.size}")
    clock = lm_run.launch(
        [*cmd, *lm_run.flags(optimizer, int(devices), seed, extra)], workdir / "log"
    )
    records, config = lm_run.records(workdir), json.loads((workdir / "config.json").read_text())
    entry = dict(key=key, spec=spec, split=split, seed=seed, lr=lr, **clock)
    entry.update(steps=config["total_steps"], curve=lm_run.result(records))
    shutil.rmtree(workdir)
    return entry, records, config

  def check_time(self, kind: str) -> None:
    """Raises :class:`CallEnds` when a ``kind`` launch now would outlast ``--stop_after``."""
    if self.args.stop_after is None:
      return
    walls = lambda k: [e["wall"] for e in self.done.values() if e["key"].startswith(k)]
    first = max(walls("probe"), default=0.0) + self.args.seconds if kind == "run" else 0.0
    estimate = max(walls(kind), default=first)
    if time.perf_counter() - self.begun + estimate > self.args.stop_after:
      raise CallEnds(f"{kind} of about {estimate:.0f} s")

  def keep(self, entry: dict) -> None:
    """Appends ``entry`` to ``--results`` (one line) and holds it."""
    with open(self.args.results, "a") as f:
      f.write(json.dumps(entry) + "\n")
    self.done[entry["key"]] = entry


def load(path: str) -> dict:
  """``--results``' entries by key (none when the file is not there yet)."""
  lines = pathlib.Path(path).read_text().splitlines() if pathlib.Path(path).exists() else []
  return {entry["key"]: entry for entry in map(json.loads, lines)}


def check_data(args, spec: str, probe: dict, splits: list[str]) -> None:
  """``reach.check_warmup`` and ``reach.check_one_epoch`` of ``spec``'s runs on each of
  ``splits``, from its probe."""
  steps = 1 + reach.budget_steps(probe["rate"], args.seconds)
  reach.check_warmup(spec, steps, probe["warmup"], probe["rate"], args.seconds)
  for split in splits:
    tokens = probe["train_tokens"][split]
    reach.check_one_epoch(
        spec, steps, probe["tokens_per_step"], tokens, probe["rate"], args.seconds
    )


def tune(sweep: Sweep, specs: list[str]) -> dict[str, float]:
  """Each run's lr: that of the lowest final loss on the tuning split, seed ``TUNE_SEED``."""
  best = {}
  for spec in specs:
    losses = {}
    for lr in sweep.args.lrs:
      entry = sweep.train(spec, "tune", TUNE_SEED, lr)
      print(reach.row(entry), flush=True)
      losses[lr] = reach.final(entry["curve"])[0]
    best[spec] = min(losses, key=losses.get)
  return best


def evaluate(sweep: Sweep, lrs: dict[str, float]) -> dict[str, list[dict]]:
  """Each run at its lr on the eval split, seed by seed (every run's seed 0 first)."""
  runs = {spec: [] for spec in lrs}
  for seed in range(sweep.args.seeds):
    for spec, lr in lrs.items():
      runs[spec].append(sweep.train(spec, "eval", seed, lr))
      print(reach.row(runs[spec][-1]), flush=True)
  return runs


def plot(runs: dict[str, list[dict]], path: str, title: str) -> str:
  """Draws each run's eval loss against its training seconds into ``path``, with the
  baseline's final losses and ``reach.GOAL`` of its seconds; returns the line to print."""
  try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    return (
        'no PNG: matplotlib is not installed (pip install -e ".[plot]"); the same command '
        "where it is draws it from the runs in --results, training none"
    )
  base, *_ = runs
  fig, ax = plt.subplots(figsize=(7, 4.5))
  for color, (spec, entries) in enumerate(runs.items()):
    for entry in entries:
      points = sorted(zip(entry["curve"]["seconds"].values(), entry["curve"]["evals"].values()))
      style = ("-", "--", ":", "-.")[entry["seed"] % 4]
      ax.plot(*zip(*points), f"C{color}{style}", marker=".", label=f"{spec} seed {entry['seed']}")
  finals = [reach.final(entry["curve"]) for entry in runs[base]]
  for loss, _ in finals:
    ax.axhline(loss, color="grey", linewidth=0.8, linestyle=":")
  goal = reach.GOAL * sum(seconds for _, seconds in finals) / len(finals)
  ax.axvline(goal, color="grey", linestyle="--", label=f"{reach.GOAL} x {base}'s seconds")
  ax.set(xlabel="training seconds", ylabel="eval loss", title=title)
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return f"eval loss against training seconds: {path}"


def sweep(args) -> None:
  """The equal-seconds mode of ``python -m benchmarks.quality``: probes, tuning, eval runs,
  then the table and the PNG (see the module's docstring)."""
  specs = args.runs.split(",") if args.runs else list(RUNS)
  cache = pathlib.Path(args.cache)
  cache.mkdir(parents=True, exist_ok=True)
  args.results = args.results or str(cache / "seconds.jsonl")
  args.png = args.png or str(cache / "seconds.png")
  for path in (args.results, args.png):
    pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
  runs = Sweep(args, load(args.results))
  tuned = args.split == "tune" or len(args.lrs) > 1
  try:
    for spec in specs:  # Each budget checked before anything else trains.
      probe = runs.probe(spec)
      rate, tokens, first = probe["rate"], probe["tokens_per_step"], probe["first"]
      print(f"{spec}: {rate:.3f} steps/s, {tokens} tokens a step, start-up {first:.0f} s")
      check_data(args, spec, probe, ["tune"] * tuned + ["eval"] * (args.split == "eval"))
    print(reach.HEADER, "|---" * (reach.HEADER.count("|") - 1) + "|", sep="\n", flush=True)
    lrs = tune(runs, specs) if tuned else {spec: args.lrs[0] for spec in specs}
    print("lr per run:", ", ".join(f"{spec} {lr:g}" for spec, lr in lrs.items()), flush=True)
    if args.split == "tune":
      return
    done = evaluate(runs, lrs)
  except CallEnds as ends:
    print(f"stopped: a {ends} would end after --stop_after; call again to go on", flush=True)
    return
  print("", *reach.table(done), sep="\n")
  title = f"{args.size}, seq {args.seq_len} x {args.batch_size}, {args.dtype}: {args.seconds:g} s"
  print(plot(done, args.png, title), flush=True)
