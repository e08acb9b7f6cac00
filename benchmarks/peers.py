"""The project's Kron, Shampoo and Muon against the published implementations, in one loop.

  python -m benchmarks.peers [--config lm:size=small] [--config.key=value ...] \
      [--pairs kron,kron_tiles,shampoo,muon] [--steps 5] [--rounds 3] [--sequential] \
      [--skip_flops] [--seconds N]

Each pair runs the trainer's step of one config twice (``build.compile_step``: the same model,
loss, plan strategy, batch sharding and batches); only the optimizer differs. Ours is the
registry's, set to the peer's math where the two differ; the peer is psgd-jax's ``kron``,
precondition-opt's ``distributed_shampoo`` or ``optax.contrib.muon`` (imported through
``benchmarks/compat.py``) at the config's learning rate schedule, after the same gradient
clipping, its state planned by following the params as any optax state is. Both refresh
their preconditioners every step. Each :class:`Pair` gives every argument of both
constructors (:func:`unpinned`), no weight decay on either side. On a scanned model each side
preconditions every layer of a stacked param on its own. The pairs:

  kron        ours unblocked (psgd-jax's layout: one Q per param dim) vs psgd-jax's kron
  kron_tiles  ours at its default 256-tiles vs psgd-jax's kron
  shampoo     ours at the peer's block size, RMSProp grafting, preconditioned from the first
              step, vs distributed_shampoo (the same updates within 5e-4: test_peers.py)
  muon        ours vs optax.contrib.muon

Columns, ours then the peer's, and ours / peer: compile seconds (the persistent compilation
cache off), the median step seconds over ``--rounds`` rounds (alternating the two sides, or
``--sequential``: one side built, timed and freed, then the other), wire bytes per device of
the compiled step (``benchmarks/traffic.py``), optimizer state bytes per device, update FLOPs
per device (XLA's count of one update; ``--skip_flops``: not counted, a compile less), and the
loss after the timed steps. Prints a markdown table, each row as its pair ends; ``--seconds``
starts no pair that the longest so far says would end after it.
"""

import os

from trainers import ONE_BLAS_THREAD

os.environ.setdefault(*ONE_BLAS_THREAD)

import contextlib
import dataclasses
import functools
import inspect
import io
import itertools
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import optax

import bv_sharding as bvs
from benchmarks import compat, traffic
from benchmarks.step_traffic import update_flops
from benchmarks.throughput import init_state
from benchmarks.timing import WARMUP, seconds_per_step
from bv_sharding import optimizers
from bv_sharding.optimizers import matrix_dims
from trainers import build, steps
from trainers.input import batching
from trainers.settings import cli

compat.add_removed_names()

from precondition import distributed_shampoo  # noqa: E402
from psgd_jax import kron as psgd_kron  # noqa: E402

# Arguments the registry sets itself: the schedule, the params' layout, ``config.wd`` (0 in
# every pair: :func:`ours_config`) and its decay mask.
FROM_THE_REGISTRY = frozenset(
    {"learning_rate", "layout", "weight_decay", "mask", "weight_decay_mask"}
)
DTYPE = "float32"  # Both sides' state (ours: ``config.state_dtype`` and Kron's own dtypes).
SHAMPOO_BLOCK = 256  # Both Shampoos' block size (ours' default; 128 before 2026-12-07).
# Pools of tiles padded to at most 1.5x their tiles keep their state where they run (the
# trainer's registry's default).
RESIDENT_PADDING = 1.5
EVERY_DIM = 2**31 - 1  # No dim is above it: distributed_shampoo preconditions every one, as ours.


@dataclasses.dataclass(frozen=True)
class Pair:
  """One pair, every argument of both sides given, so a default changed in either library
  does not change its math (:func:`unpinned` names any left out).

  ``name``: ours' registry name; ``ours``: every argument of its factory but those
  :data:`FROM_THE_REGISTRY`; ``peer``: the published constructor; ``peer_args``: the params'
  stacked leaves (a bool per leaf: dim 0 is a stack of layers) -> every argument of ``peer``
  but its learning rate; ``by_layer``: the peer, which has no option for stacked layers, is
  vmapped over the layers of a stacked leaf, each a param of its own, as ours preconditions
  it (:func:`layer_by_layer`).
  """

  name: str
  ours: dict
  peer: Callable
  peer_args: Callable[[Any], dict]
  by_layer: bool = False

  def peer_tx(self, learning_rate, stacked) -> optax.GradientTransformation:
    """The peer at ``learning_rate`` for params whose ``stacked`` leaves are layer stacks."""
    tx = self.peer(learning_rate, **self.peer_args(stacked))
    return layer_by_layer(tx, stacked) if self.by_layer else tx


def layer_by_layer(tx, stacked) -> optax.GradientTransformation:
  """``tx`` on params whose ``stacked`` leaves (a bool per leaf) are stacks of layers: ``tx``
  vmapped over their layers (each layer a param of its own, as the unscanned model has it)
  and ``tx`` on the other leaves; ``tx`` itself where no leaf is stacked.

  Example:
    >>> tx = layer_by_layer(optax.scale_by_rss(), {"w": True, "b": False})
    >>> params = {"w": jax.numpy.ones((3, 2)), "b": jax.numpy.ones(2)}
    >>> layers, rest = tx.init(params)
    >>> layers.sum_of_squares["w"].shape, rest.sum_of_squares["b"].shape
    ((3, 2), (2,))
    >>> tx.update(params, tx.init(params))[0]["w"].shape
    (3, 2)
  """
  if not any(jax.tree.leaves(stacked)):
    return tx
  part = lambda tree, layers: jax.tree.map(lambda s, x: x if s == layers else None, stacked, tree)
  whole = lambda a, b: jax.tree.map(lambda s, x, y: x if s else y, stacked, a, b)

  def init(params):
    return jax.vmap(tx.init)(part(params, True)), tx.init(part(params, False))

  def update(updates, state, params=None):
    of = lambda layers: None if params is None else part(params, layers)
    layers = jax.vmap(tx.update)(part(updates, True), state[0], of(True))
    rest = tx.update(part(updates, False), state[1], of(False))
    return whole(layers[0], rest[0]), (layers[1], rest[1])

  return optax.GradientTransformation(init, update)


# Kron's math, one spelling on both sides (psgd-jax's arguments, which ours takes by name).
KRON = {
    "b1": 0.9,
    "preconditioner_update_probability": 1.0,
    "max_size_triangular": 8192,
    "min_ndim_triangular": 2,
    "memory_save_mode": None,
    "momentum_into_precond_update": True,
    "preconditioner_lr": 0.1,
    "preconditioner_init_scale": 1.0,  # psgd-jax's; ours sets it from the first momentum.
    "mu_dtype": DTYPE,
    "precond_dtype": DTYPE,
    "precond_update_precision": "tensorfloat32",
    "precond_grads_precision": None,
}


def ours_kron(block_size) -> dict:
  """Ours' Kron arguments at ``block_size`` (None: unblocked, psgd-jax's Q shapes)."""
  # scanned_layers None: the layout's stacked leaves, the peer's scanned_layers.
  layout = {"scanned_layers": None, "blocking": "tiles", "resident_padding": RESIDENT_PADDING}
  return {**KRON, "block_size": block_size, **layout}


def psgd(stacked) -> dict:
  """psgd-jax's kron's arguments: :data:`KRON`, each layer of a stacked leaf its own Qs.

  Its layers are vmapped, but on CPU: there jaxlib's batched triangular solve (LAPACK, its
  batch split over XLA's thread pool) can wedge that pool for good, so one layer at a time.
  """
  lax_map = {"lax_map_scanned_layers": jax.default_backend() == "cpu", "lax_map_batch_size": 1}
  return {
      **KRON,
      "weight_decay": 0.0,
      "weight_decay_mask": None,
      "scanned_layers": stacked,
      **lax_map,
  }


OURS_SHAMPOO = {
    "block_size": SHAMPOO_BLOCK,
    "beta1": 0.9,
    "beta2": 0.999,
    "epsilon": 1e-8,
    "matrix_epsilon": 1e-6,
    "update_preconditioners_freq": 1,  # The peer's preconditioning_compute_steps.
    # Preconditioned from the first step: distributed_shampoo's momentum sums preconditioned
    # steps from its first even while it applies the graft's, ours the applied ones.
    "start_preconditioning_step": 0,
    "graft_type": "rmsprop",
    "nesterov": True,
    "exponent_override": None,
    "blocking": "tiles",
    "root_method": "newton",  # The coupled Newton iteration, as the peer's eigh=False.
    "resident_padding": RESIDENT_PADDING,
    "refresh_groups": 1,  # Every tile's roots on the same steps, as the peer's.
    "skip_preconditioning_dim_size_gt": None,  # Every param preconditioned, as the peer's.
}


def precondition_opt(stacked) -> dict:
  """distributed_shampoo's arguments at ours' math (:data:`OURS_SHAMPOO`)."""
  del stacked  # Its layers are vmapped (Pair.by_layer).
  ours = OURS_SHAMPOO
  return {
      "block_size": ours["block_size"],
      "beta1": ours["beta1"],
      "beta2": ours["beta2"],
      "diagonal_epsilon": ours["epsilon"],
      "matrix_epsilon": ours["matrix_epsilon"],
      "weight_decay": 0.0,
      "start_preconditioning_step": ours["start_preconditioning_step"],
      "preconditioning_compute_steps": ours["update_preconditioners_freq"],
      "statistics_compute_steps": 1,
      "best_effort_shape_interpretation": True,
      "graft_type": distributed_shampoo.GraftingType.RMSPROP,
      "nesterov": ours["nesterov"],
      "exponent_override": 0,  # 0: 2 * the number of factors, as ours' None.
      **_distributed_shampoo_layout(),
      "moving_average_for_momentum": True,  # Ours steps by its momentum's average too.
      "skip_preconditioning_dim_size_gt": EVERY_DIM,
      "clip_by_scaled_gradient_norm": None,
      "precision": jax.lax.Precision.HIGHEST,
      "tensordot_precision": None,
      "relative_matrix_epsilon": True,
      "merge_small_dims_block_size": 4096,
      "inverse_failure_threshold": 0.1,  # A root that fails keeps the previous one.
      **_distributed_shampoo_extras(),
      "eigh": False,  # The coupled Newton iteration, as ours' root_method "newton".
  }


def _distributed_shampoo_layout() -> dict:
  """Its sharding arguments, off: its state is planned by following the params."""
  return {
      "batch_axis_name": None,
      "statistics_partition_spec": None,
      "preconditioner_partition_spec": None,
      "num_devices_for_pjit": None,
      "shard_optimizer_states": False,
      "best_effort_memory_usage_reduction": False,
  }


def _distributed_shampoo_extras() -> dict:
  """Its variants beyond ours' math, each off."""
  return {
      "lobpcg_topk_precondition": 0,
      "lobpcg_max_iter": 0,
      "precondtioner_type": distributed_shampoo.PreconditionerType.ALL,  # (sic)
      "generate_fd_metrics": False,
      "compression_rank": 0,
      "frequent_directions": False,
      "reset_preconditioner": False,
      "average_grad": False,
      "skip_preconditioning_rank_lt": 1,
      "decoupled_learning_rate": True,
      "decoupled_weight_decay": False,
      "generate_training_metrics": False,
      "reuse_preconditioner": False,
  }


# The leaves both sides train with Adam: the embedding and the head (ours' default).
ADAM_LEAVES = "embed|embedding|pos_embedding|lm_head|head"
MUON = {
    "ns_coeffs": (3.4445, -4.775, 2.0315),
    "ns_steps": 5,
    "beta": 0.95,
    "eps": 1e-8,
    "nesterov": True,
    "adam_b1": 0.9,
    "adam_b2": 0.999,
    "adam_learning_rate": None,  # Muon's own.
    # optax.contrib.muon scales no matrix update to an RMS (the registry's default does: 0.8).
    "consistent_rms": None,
}


def optax_muon(stacked) -> dict:
  """optax.contrib.muon's arguments: :data:`MUON`, and ours' matrices (every leaf of 2 or more
  dims but norm scales, biases and the embedding and head, a stacked leaf one matrix per
  layer)."""
  del stacked  # matrix_dims reads each leaf's dims.
  adam = {"adam_eps_root": 0.0, "adam_weight_decay": 0.0}
  variant = {"adaptive": False, "preconditioning": "frobenius", "mu_dtype": DTYPE}
  decay = {"weight_decay": 0.0, "weight_decay_mask": None}
  dims = functools.partial(matrix_dims, adam_leaves=ADAM_LEAVES)
  return {**MUON, **adam, **variant, **decay, "muon_weight_dimension_numbers": dims}


PAIRS = {
    "kron": Pair("kron", ours_kron(None), psgd_kron.kron, psgd),
    "kron_tiles": Pair("kron", ours_kron(256), psgd_kron.kron, psgd),
    "shampoo": Pair(
        "shampoo",
        OURS_SHAMPOO,
        distributed_shampoo.distributed_shampoo,
        precondition_opt,
        by_layer=True,
    ),
    "muon": Pair("muon", {**MUON, "adam_leaves": ADAM_LEAVES}, optax.contrib.muon, optax_muon),
}


def unpinned(pair: Pair, stacked) -> list[str]:
  """The arguments of ``pair``'s constructors it leaves to their defaults, and those it gives
  that they do not take; [] when every argument is pinned.

  Example:
    >>> unpinned(PAIRS["muon"], {})
    []
  """
  ours = inspect.signature(getattr(optimizers, pair.name)).parameters
  peer = list(inspect.signature(pair.peer).parameters)[1:]  # The learning rate is the schedule.
  peer_args = pair.peer_args(stacked)
  return [
      *(f"ours' {a}" for a in ours if a not in {*pair.ours, *FROM_THE_REGISTRY}),
      *(f"ours' {a} (not taken)" for a in pair.ours if a not in ours),
      *(f"the peer's {a}" for a in peer if a not in peer_args),
      *(f"the peer's {a} (not taken)" for a in peer_args if a not in peer),
  ]


def ours_config(config, pair: str):
  """``config`` training our side of ``pair``: its optimizer's every argument, no weight decay
  (neither side has any) and the state in :data:`DTYPE`."""
  config = config.copy_and_resolve_references()
  config.optax_name, config.optax = PAIRS[pair].name, dict(PAIRS[pair].ours)
  config.wd, config.state_dtype = 0.0, DTYPE
  return config


def peer_run(run: build.Run, pair: str) -> build.Run:
  """``run`` with the peer of ``pair`` as its optimizer: clipped as the config clips, at
  the config's learning rate schedule, its state planned by following the params."""
  config, stacked = run.config, run.layout.stacked
  clip = config.grad_clip_norm
  tx = optax.chain(
      optax.clip_by_global_norm(clip) if clip else optax.identity(),
      PAIRS[pair].peer_tx(run.learning_rates["lr"], stacked),
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


def side(run: build.Run, num_batches: int, flops: bool = True) -> Side:
  """``run``'s step compiled (timed), its state born and ``num_batches`` global batches;
  ``flops``: XLA's count of one update, which compiles the update alone (else NaN)."""
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
    count = update_flops(run.tx, run.plan.abstract()) if flops else float("nan")
  wire = traffic.wire_bytes(step.train.as_text())
  return Side(run, step.train, state, batches, seconds, wire, count)


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


@dataclasses.dataclass(frozen=True)
class Timing:
  """How a pair is timed: ``steps`` timed steps per round, ``rounds`` rounds; ``sequential``:
  each side compiled, timed and its state freed before the other is built (one state on the
  device at a time), else both built and their rounds alternated; ``flops``: count them."""

  steps: int = 5
  rounds: int = 3
  sequential: bool = False
  flops: bool = True


def measure(config, pair: str, timing: Timing) -> dict[str, Side]:
  """``{"ours", "peer"}`` of ``pair`` on ``config``, timed as ``timing`` says; a line to
  stderr as each side is compiled."""
  mesh = bvs.make_mesh(config.mesh, axis_types=build.axis_types(config))
  ours = build.build(ours_config(config, pair), mesh)
  runs = {"ours": ours, "peer": peer_run(ours, pair)}
  built = lambda name: _noted(pair, name, side(runs[name], WARMUP + timing.steps, timing.flops))
  if timing.sequential:
    return {name: _freed(_rounds([built(name)], timing)[0]) for name in runs}
  return dict(zip(runs, _rounds([built(name) for name in runs], timing)))


def _rounds(sides: list[Side], timing: Timing) -> list[Side]:
  for _ in range(timing.rounds):
    for one in sides:
      time_round(one, timing.steps)
  return sides


def _noted(pair: str, name: str, one: Side) -> Side:
  print(f"{pair}, {name}: compiled in {one.compile_seconds:.1f} s", file=sys.stderr, flush=True)
  return one


def _freed(one: Side) -> Side:
  one.state, one.batches = None, []
  return one


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


def run_pairs(config, pairs: list[str], timing: Timing, seconds: float) -> None:
  """Prints each pair's row as it is measured; a pair starts only while ``seconds`` (since
  the first started) leave as long as the longest pair took, else the rest are named."""
  start, longest = time.monotonic(), 0.0
  for i, pair in enumerate(pairs):
    if seconds - (time.monotonic() - start) < longest:
      print(f"\nOut of --seconds {seconds:g}; the rest: --pairs {','.join(pairs[i:])}")
      return
    began = time.monotonic()
    print(row(pair, measure(config, pair, timing)), flush=True)
    longest = max(longest, time.monotonic() - began)


def load(spec: str, overrides: list[str]):
  """``configs/<spec>`` (``lm:size=small``) with the trainer's ``--config.key=value`` flags."""
  name, _, arg = spec.partition(":")
  return cli.config_from_args([f"--config=configs/{name}.py{':' * bool(arg)}{arg}", *overrides])


@cli.command
def main(argv=None):
  parser = cli.Parser("python -m benchmarks.peers", __doc__)
  parser.add_argument("--config", default="lm:size=small")
  parser.add_argument("--pairs", default=",".join(PAIRS))
  parser.add_argument("--steps", type=int, default=5, help="timed steps per round")
  parser.add_argument("--rounds", type=int, default=3, help="rounds, alternating ours and peer")
  parser.add_argument("--sequential", action="store_true", help="one side after the other")
  parser.add_argument("--skip_flops", action="store_true", help="no update FLOPs (a compile less)")
  parser.add_argument("--seconds", type=float, default=float("inf"), help="start no pair after")
  args, overrides = parser.parse_known_args(argv)
  # distributed_shampoo asks for float64 roots; without jax_enable_x64 they are float32.
  warnings.filterwarnings("ignore", "Explicitly requested dtype float64", UserWarning)
  jax.config.update("jax_num_cpu_devices", 8)
  jax.config.update("jax_enable_compilation_cache", False)
  config = load(args.config, overrides)
  timing = Timing(args.steps, args.rounds, args.sequential, not args.skip_flops)
  pairs = args.pairs.split(",")
  stacked = build.build(
      config, bvs.make_mesh(config.mesh, axis_types=build.axis_types(config))
  ).layout.stacked
  gaps = {pair: unpinned(PAIRS[pair], stacked) for pair in pairs}
  print(
      f"configs/{args.config} {' '.join(overrides)} on {jax.device_count()} "
      f"{jax.devices()[0].platform} devices; median of {args.rounds} "
      f"{'' if args.sequential else 'alternating '}rounds of {args.steps} steps after {WARMUP} "
      "warm-up; each cell ours / peer / ratio"
      + "".join(f"; {pair} leaves to the defaults: {', '.join(g)}" for pair, g in gaps.items() if g)
      + "\n"
  )
  print(
      "| pair | compile s | step s | wire MiB/device | state MiB/device | update GFLOP/device "
      "| loss after the rounds |"
  )
  print("|---|---|---|---|---|---|---|")
  run_pairs(config, pairs, timing, args.seconds)


if __name__ == "__main__":
  main()
