"""The optimizer update's cost against the forward and backward pass it rides on.

  python -m benchmarks.amortisation [--configs lm:size=small,lm:size=1b] \
      [--optimizers kron,shampoo,soap,muon] [--tokens 1048576]

For each config the trainer's programs are compiled (never run) on 8 simulated devices, and
XLA's own counts (``cost_analysis``: FLOPs and bytes accessed, per device) are read from them:

* the update: the optimizer's ``tx.update`` alone, jitted on the plan's abstract state (its
  shardings), for each optimizer and for adamw;
* the forward and backward pass: adamw's train step less adamw's update, compiled at the
  config's batch and at twice it. With the sequence length fixed both counts are linear in the
  batch, so the two compiles give them at any batch: at the config's, and at ``--tokens`` a step
  (a production batch; 1M tokens by default).

A row gives the update's GFLOP and GB per device and each as a fraction of the forward and
backward pass's at both batches. The step counter is traced, so where an update refreshes its
preconditioner under ``lax.cond`` (SOAP's bases) XLA counts the costlier branch: a refresh
step, an upper bound on the others
(``python -m benchmarks.refresh_cost`` times SOAP's both ways). LAPACK's calls (``eigh``, QR)
are not in XLA's FLOPs; the matmuls around them are.
"""

import os

from trainers import ONE_BLAS_THREAD

os.environ.setdefault(*ONE_BLAS_THREAD)  # Before numpy loads OpenBLAS (trainers/__init__.py).

import dataclasses

import flax.linen as nn
import jax

jax.config.update("jax_num_cpu_devices", 8)

import bv_sharding as bvs  # noqa: E402
from benchmarks.step_traffic import CONFIGS_HELP, config_for, config_specs  # noqa: E402
from trainers import build  # noqa: E402
from trainers.settings import cli  # noqa: E402

CONFIGS = ("lm:size=small",)
OPTIMIZERS = ("kron", "shampoo", "soap", "muon")
TOKENS = 2**20


@dataclasses.dataclass(frozen=True)
class Cost:
  """XLA's count of one program per device: FLOPs and bytes accessed."""

  flops: float
  bytes: float

  @classmethod
  def of(cls, compiled) -> "Cost":
    counts = compiled.cost_analysis() or {}
    return cls(float(counts.get("flops", 0.0)), float(counts.get("bytes accessed", 0.0)))

  def __sub__(self, other: "Cost") -> "Cost":
    return Cost(self.flops - other.flops, self.bytes - other.bytes)

  def at(self, slope: "Cost", batch: float) -> "Cost":
    """This cost at batch 0 plus ``slope`` per batch row, at ``batch`` rows.

    Example:
        >>> Cost(1.0, 2.0).at(Cost(3.0, 4.0), 2)
        Cost(flops=7.0, bytes=10.0)
    """
    return Cost(self.flops + batch * slope.flops, self.bytes + batch * slope.bytes)


def built(spec: str, optimizer: str, batch_size: int | None = None) -> build.Run:
  """The trainer's run of ``configs/<spec>`` training ``optimizer`` (at ``batch_size`` rows)."""
  config = config_for(spec, optimizer)
  if batch_size is not None:
    config.batch_size = batch_size
  return build.build(config, bvs.make_mesh(config.mesh, axis_types=build.axis_types(config)))


def update_cost(run: build.Run) -> Cost:
  """The cost of ``run``'s optimizer update alone, on the plan's abstract state."""
  state = run.plan.abstract()
  update = lambda grads, opt, params: run.tx.update(grads, opt, params)
  with jax.set_mesh(run.mesh), nn.logical_axis_rules(run.config.sharding_rules):
    lowered = jax.jit(update).lower(state["params"], state["opt"], state["params"])
    return Cost.of(lowered.compile())


def step_cost(run: build.Run) -> Cost:
  """The cost of ``run``'s whole train step (``build.compile_step``)."""
  return Cost.of(build.compile_step(run).train)


def model_cost(spec: str, base: build.Run, update: Cost) -> tuple[Cost, Cost]:
  """(forward and backward at batch 0, their cost per batch row) of ``spec``: adamw's step
  (``base``, ``update`` its update's cost) less its update, at its batch and at twice it."""
  rows = base.config.batch_size
  at_rows = step_cost(base) - update
  at_twice = step_cost(built(spec, "adamw", 2 * rows)) - update
  slope = Cost((at_twice.flops - at_rows.flops) / rows, (at_twice.bytes - at_rows.bytes) / rows)
  return at_rows.at(slope, -rows), slope


def rows(spec: str, optimizers: list[str], tokens: int) -> list[str]:
  """The table's rows of ``spec``, one per optimizer (adamw's first)."""
  base = built(spec, "adamw")
  updates = {"adamw": update_cost(base)}
  zero, slope = model_cost(spec, base, updates["adamw"])
  batch, per_row = base.config.batch_size, base.config.seq_len
  here, there = zero.at(slope, batch), zero.at(slope, tokens / per_row)
  out = []
  for name in ["adamw", *(o for o in optimizers if o != "adamw")]:
    update = updates.get(name) or update_cost(built(spec, name))
    out.append(
        f"| {spec} | {name} | {update.flops / 1e9:.3f} | {update.bytes / 1e9:.3f} | "
        f"{here.flops / 1e9:.1f} | {update.flops / here.flops:.3f} | "
        f"{update.bytes / here.bytes:.3f} | {there.flops / 1e9:.0f} | "
        f"{update.flops / there.flops:.4f} | {update.bytes / there.bytes:.4f} |"
    )
  return out


@cli.command
def main(argv=None):
  parser = cli.Parser("python -m benchmarks.amortisation", __doc__)
  parser.add_argument("--configs", default=",".join(CONFIGS), help=CONFIGS_HELP)
  parser.add_argument("--optimizers", default=",".join(OPTIMIZERS))
  parser.add_argument("--tokens", type=int, default=TOKENS, help="the production batch's tokens")
  args = parser.parse_args(argv)
  k = args.tokens // 1024
  print(
      "| config | optimizer | update GFLOP/device | update GB/device | fwd+bwd GFLOP/device | "
      f"FLOPs x fwd+bwd | bytes x fwd+bwd | fwd+bwd GFLOP/device at {k}k tokens | "
      f"FLOPs x fwd+bwd at {k}k | bytes x fwd+bwd at {k}k |"
  )
  print("|---|---|---|---|---|---|---|---|---|---|")
  for spec in config_specs(args.configs):
    for line in rows(spec, args.optimizers.split(","), args.tokens):
      print(line, flush=True)


if __name__ == "__main__":
  main()
