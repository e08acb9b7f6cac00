"""The project's Kron, Shampoo and Muon against the published implementations, in one loop.

  python -m benchmarks.peers [--config lm:size=small] [--pairs kron,kron_tiles,shampoo,muon] \
      [--steps 5] [--rounds 3]

Each pair runs the trainer's step of one config twice (``build.compile_step``: the same model,
loss, plan strategy, batch sharding and batches); only the optimizer differs. Ours is the
registry's, set to the peer's math where the two differ; the peer is psgd-jax's ``kron``,
precondition-opt's ``distributed_shampoo`` or ``optax.contrib.muon`` (imported through
``benchmarks/compat.py``) at the config's learning rate schedule, after the same gradient
clipping, its state planned by following the params as any optax state is. Both refresh
their preconditioners every step. The pairs:

  kron        ours unblocked (psgd-jax's layout: one Q per param dim) vs psgd-jax's kron
  kron_tiles  ours at its default 256-tiles vs psgd-jax's kron
  shampoo     ours at the peer's block size, RMSProp grafting, preconditioned from the first
              step, vs distributed_shampoo (the same updates within 5e-4: test_peers.py)
  muon        ours vs optax.contrib.muon

Columns, ours then the peer's, and ours / peer: compile seconds (the persistent compilation
cache off), the median step seconds over ``--rounds`` rounds that alternate the two, wire
bytes per device of the compiled step (``benchmarks/traffic.py``), optimizer state bytes per
device, update FLOPs per device (XLA's count of one update), and the loss after the timed
steps. Prints a markdown table.
"""

import os

from trainers import ONE_BLAS_THREAD

os.environ.setdefault(*ONE_BLAS_THREAD)

import contextlib
import dataclasses
import io
import itertools
import statistics
import time

import flax.linen as nn
import jax
import optax

import bv_sharding as bvs
from benchmarks import compat, traffic
from benchmarks.step_traffic import load_config, update_flops
from benchmarks.throughput import init_state
from benchmarks.timing import WARMUP, seconds_per_step
from trainers import build, steps
from trainers.input import batching
from trainers.settings import cli

compat.add_removed_names()

from precondition import distributed_shampoo  # noqa: E402
from psgd_jax import kron as psgd_kron  # noqa: E402

SHAMPOO_BLOCK = 128  # Both Shampoos' block size (distributed_shampoo's blocks are per param).
SHAMPOO_EPSILON = 1e-8  # Both grafts' denominator epsilon (ours' default).


def psgd(lr):
  return psgd_kron.kron(lr, preconditioner_update_probability=1.0, preconditioner_init_scale=1.0)


KRON = {"preconditioner_update_probability": 1.0, "preconditioner_init_scale": 1.0}  # As psgd's.


def precondition_opt(lr):
  return distributed_shampoo.distributed_shampoo(
      lr,
      block_size=SHAMPOO_BLOCK,
      graft_type=distributed_shampoo.GraftingType.RMSPROP,
      diagonal_epsilon=SHAMPOO_EPSILON,
      start_preconditioning_step=0,
      preconditioning_compute_steps=1,
      eigh=False,  # The coupled Newton iteration, as ours' root_method "newton".
      moving_average_for_momentum=True,  # Ours steps by its momentum's average too.
      generate_training_metrics=False,
  )


# name -> (ours: optax_name and config.optax, the peer: a learning rate -> transformation).
PAIRS = {
    "kron": (("kron", {**KRON, "block_size": None}), psgd),
    "kron_tiles": (("kron", KRON), psgd),
    "shampoo": (
        # Preconditioned from the first step: distributed_shampoo's momentum sums preconditioned
        # steps from its first even while it applies the graft's, ours the applied ones.
        (
            "shampoo",
            {
                "block_size": SHAMPOO_BLOCK,
                "start_preconditioning_step": 0,
                "graft_type": "rmsprop",
                "epsilon": SHAMPOO_EPSILON,
                "update_preconditioners_freq": 1,  # The peer's preconditioning_compute_steps.
                "root_method": "newton",
            },
        ),
        precondition_opt,
    ),
    # optax.contrib.muon scales no matrix update to an RMS (the registry's default does: 0.8).
    "muon": (("muon", {"consistent_rms": None}), optax.contrib.muon),
}


def ours_config(config, pair: str):
  """``config`` training our side of ``pair``."""
  (name, settings), _ = PAIRS[pair]
  config = config.copy_and_resolve_references()
  config.optax_name = name
  config.optax.update(settings)
  return config


def peer_run(run: build.Run, pair: str) -> build.Run:
  """``run`` with the peer of ``pair`` as its optimizer: clipped as the config clips, at
  the config's learning rate schedule, its state planned by following the params."""
  config, (_, peer) = run.config, PAIRS[pair]
  clip = config.grad_clip_norm
  tx = optax.chain(
      optax.clip_by_global_norm(clip) if clip else optax.identity(),
      peer(run.learning_rates["lr"]),
  )
  strategy, rules = config.sharding_strategy, config.sharding_rules
  params = bvs.plan({"params": jax.eval_shape(run.init)}, strategy, run.mesh, rules=rules)
  plan = bvs.plan(
      steps.abstract_state(run.init, tx), strategy, run.mesh, rules=rules, params=params
  )
  return dataclasses.replace(run, tx=tx, plan=plan)


@dataclasses.dataclass
class Side:
  """One side of a pair, compiled and born: its figures and what a round needs."""

  run: build.Run
  compiled: object
  state: object
  batches: list
  compile_seconds: float
  wire: float
  flops: float
  times: list = dataclasses.field(default_factory=list)
  loss: float = float("nan")


def side(run: build.Run, num_batches: int) -> Side:
  """``run``'s step compiled (timed), its state born and ``num_batches`` global batches."""
  start = time.perf_counter()
  step = build.compile_step(run)
  seconds = time.perf_counter() - start
  config = run.config
  local = run.task.batches(run.task.train, global_batch=config.batch_size, seed=0)
  batches = [
      batching.to_global(b, step.batch_sharding) for b in itertools.islice(local, num_batches)
  ]
  # psgd-jax prints its state's sizes as it builds it: kept out of the table.
  with jax.set_mesh(run.mesh), nn.logical_axis_rules(config.sharding_rules):
    with contextlib.redirect_stdout(io.StringIO()):
      state = init_state(run)
    flops = update_flops(run.tx, run.plan.abstract())
  wire = traffic.wire_bytes(step.train.as_text())
  return Side(run, step.train, state, batches, seconds, wire, flops)


def time_round(one: Side, num_steps: int) -> None:
  """One timed round of ``one`` from the start of its batches; its last loss kept."""
  config = one.run.config
  with jax.set_mesh(one.run.mesh), nn.logical_axis_rules(config.sharding_rules):
    losses = []
    record = lambda s, b: _recorded(one.compiled, s, b, losses)
    one.state, seconds = seconds_per_step(record, one.state, one.batches, num_steps)
  one.times.append(seconds)
  one.loss = float(losses[-1])


def _recorded(compiled, state, batch, losses: list):
  state, metrics = compiled(state, batch)
  losses.append(metrics["loss"])
  return state, metrics


def measure(config, pair: str, num_steps: int, rounds: int) -> dict[str, Side]:
  """``{"ours", "peer"}`` of ``pair`` on ``config``, their rounds alternating."""
  mesh = bvs.make_mesh(config.mesh, axis_types=build.axis_types(config))
  ours = build.build(ours_config(config, pair), mesh)
  sides = {"ours": ours, "peer": peer_run(ours, pair)}
  sides = {name: side(run, WARMUP + num_steps) for name, run in sides.items()}
  for _ in range(rounds):
    for one in sides.values():
      time_round(one, num_steps)
  return sides


def row(pair: str, sides: dict[str, Side]) -> str:
  """The table's row of ``pair``: each figure ours / peer / ratio."""
  ours, peer = sides["ours"], sides["peer"]
  figures = [
      (ours.compile_seconds, peer.compile_seconds, "{:.1f}"),
      (statistics.median(ours.times), statistics.median(peer.times), "{:.3f}"),
      (ours.wire / 2**20, peer.wire / 2**20, "{:.2f}"),
      (ours.run.plan.bytes_per_device / 2**20, peer.run.plan.bytes_per_device / 2**20, "{:.2f}"),
      (ours.flops / 1e9, peer.flops / 1e9, "{:.3f}"),
  ]
  cells = [
      f"{fmt.format(a)} / {fmt.format(b)} / {a / b if b else float('nan'):.2f}"
      for a, b, fmt in figures
  ]
  return f"| {pair} | " + " | ".join(cells) + f" | {ours.loss:.3f} / {peer.loss:.3f} |"


@cli.command
def main(argv=None):
  parser = cli.Parser("python -m benchmarks.peers", __doc__)
  parser.add_argument("--config", default="lm:size=small")
  parser.add_argument("--pairs", default=",".join(PAIRS))
  parser.add_argument("--steps", type=int, default=5, help="timed steps per round")
  parser.add_argument("--rounds", type=int, default=3, help="rounds, alternating ours and peer")
  args = parser.parse_args(argv)
  jax.config.update("jax_num_cpu_devices", 8)
  jax.config.update("jax_enable_compilation_cache", False)
  config = load_config(args.config)
  print(
      f"configs/{args.config} on {jax.device_count()} {jax.devices()[0].platform} devices; "
      f"median of {args.rounds} alternating rounds of {args.steps} steps after {WARMUP} warm-up; "
      "each cell ours / peer / ratio\n"
  )
  print(
      "| pair | compile s | step s | wire MiB/device | state MiB/device | update GFLOP/device "
      "| loss after the rounds |"
  )
  print("|---|---|---|---|---|---|---|")
  for pair in args.pairs.split(","):
    print(row(pair, measure(config, pair, args.steps, args.rounds)), flush=True)


if __name__ == "__main__":
  main()
