"""Step traffic: wire bytes of the whole compiled train step, per optimizer, on 8 simulated devices.

For configs/lm.py (small, medium) and configs/lm_tp_fsdp.py the trainer's train step
(``trainers/build.py``'s ``compile_step``: its plan and optimizer, the param layout
included) is compiled, not run, and per optimizer the table gives: wire bytes per device of every
collective (all-gather result*(g-1)/g, reduce-scatter operand*(g-1)/g, all-reduce
2*result*(g-1)/g), the ratio to the adamw step and to the FSDP minimum
3*params*(N-1)/N (params gathered twice, grads reduce-scattered), the number of
collectives, compile time, the per-device FLOPs of the optimizer update alone
(``cost_analysis``) and their ratio to the single-device update's FLOPs / N, the
state bytes per device over the ideal (total / N, the state counted as checkpointed:
``trainers/stored.py``, so a pool's padding where SOAP keeps its state where it runs counts
against it), and whether XLA printed
"Involuntary full rematerialization" while compiling. "between fits x adamw" counts a step
that takes no ``lax.cond``'s true branch (``traffic.wire_bytes(hlo, branch=0)``): Kron's
between its Q fits, Shampoo's between root refreshes, whose pools move the fit's inputs in and
the new factors back only on those steps. The step compiled is the one an accelerator runs:
its pools skip those moves under ``lax.cond`` (``gating.skipping(True)``), where on CPU
devices they make them every step (``gating.skips_here``). Kron and Shampoo run with their
default blocks (the param's fixed tiles) and as "kron:local"/"shampoo:local" with
shard-local blocks (``config.optax.blocking="local"``). Each config is compiled on a mesh
with Auto axes and on one with Explicit axes (``config.mesh_axis_types``; the loss gathers
the params to their compute specs, the model lays out its activations); "x auto" is an
Explicit row's wire bytes over its Auto row's. "gathers x P" and "reductions x P"
split the bytes into all-gathers and all-reduces/reduce-scatters, in units of the params'
P*(N-1)/N: XLA:CPU has no reduce-scatter (it all-reduces and slices, 2 units), so on
this backend a step whose layers are scanned, which re-gathers the params in the
backward loop, sends 2 + 2 units where a backend with reduce-scatter sends 2 + 1.

  python -m benchmarks.step_traffic [--configs lm:size=small] [--optimizers adamw,kron] \
      [--axis_types auto,explicit]
"""

import os

from trainers import ONE_BLAS_THREAD

os.environ.setdefault(*ONE_BLAS_THREAD)  # Before numpy loads OpenBLAS (trainers/__init__.py).

import contextlib
import importlib
import itertools
import tempfile
import time

import jax

jax.config.update("jax_num_cpu_devices", 8)

import flax.linen as nn  # noqa: E402

import bv_sharding as bvs  # noqa: E402
from benchmarks import traffic, zoo  # noqa: E402
from bv_sharding.optimizers import skipping  # noqa: E402
from trainers import build  # noqa: E402
from trainers.settings import cli  # noqa: E402

CONFIGS = ("lm:size=small", "lm:size=medium", "lm_tp_fsdp:size=small")
# "<name>:local": the optimizer with shard-local blocks (config.optax.blocking="local").
OPTIMIZERS = ("adamw", "kron", "kron:local", "shampoo", "shampoo:local", "muon", "soap")
REMAT = "Involuntary full rematerialization"


@contextlib.contextmanager
def captured_stderr():
  """Collects what the process (XLA's C++ included) writes to fd 2; yields a list that gets it."""
  out = []
  saved = os.dup(2)
  with tempfile.TemporaryFile(mode="w+b") as tmp:
    os.dup2(tmp.fileno(), 2)
    try:
      yield out
    finally:
      os.dup2(saved, 2)
      os.close(saved)
      tmp.seek(0)
      out.append(tmp.read().decode(errors="replace"))


CONFIGS_HELP = "config specs, comma-separated (config_specs: lm:size=small,layers=1 is one)"


def config_specs(text: str) -> list[str]:
  """The config specs of a ``--configs`` value: ``name[:arg]`` items joined by commas, where an
  item with ``=`` and no ``:`` continues the last spec's arg (its ``key=value,...``).

  Example:
      >>> config_specs("lm:size=small,layers=1,lm_tp_fsdp:size=tiny,lm")
      ['lm:size=small,layers=1', 'lm_tp_fsdp:size=tiny', 'lm']
  """
  specs: list[str] = []
  for item in filter(None, text.split(",")):
    if specs and ":" not in item and "=" in item:
      specs[-1] += f",{item}"
    else:
      specs.append(item)
  return specs


def load_config(spec: str):
  name, _, arg = spec.partition(":")
  return importlib.import_module(f"configs.{name}").get_config(arg or None)


def config_for(spec: str, optimizer: str):
  """``configs/<spec>`` training ``optimizer`` (``zoo.train_with``: ``<name>:local`` too)."""
  return zoo.train_with(load_config(spec), optimizer)


def abstract(plan):
  """The plan's tree as ShapeDtypeStructs without shardings (``plan.abstract()`` has them)."""
  return plan.treedef.unflatten([jax.ShapeDtypeStruct(e.shape, e.dtype) for e in plan.entries])


def update_flops(tx, state) -> float:
  """FLOPs per device of one optimizer update of ``state`` (``cost_analysis``)."""
  update = lambda grads, opt, params: tx.update(grads, opt, params)
  compiled = jax.jit(update).lower(state["params"], state["opt"], state["params"]).compile()
  return float(compiled.cost_analysis().get("flops", 0.0))


def compile_step(config):
  """Compiles the trainer's step (``build.compile_step``) as an accelerator runs it (gated moves
  skipped under ``lax.cond``): (HLO text, XLA's stderr while compiling, seconds, extras)."""
  mesh = bvs.make_mesh(config.mesh, axis_types=build.axis_types(config))
  run = build.build(config, mesh)
  start = time.perf_counter()
  with captured_stderr() as log, skipping(True):
    hlo = build.compile_step(run).train.as_text()
  seconds = time.perf_counter() - start
  with jax.set_mesh(mesh), nn.logical_axis_rules(config.sharding_rules), skipping(True):
    flops = update_flops(run.tx, run.plan.abstract())
  return hlo, log[0], seconds, (mesh, run.plan, flops)


def in_param_units(hlo: str, plan) -> tuple[float, float]:
  """(all-gather, all-reduce + reduce-scatter) wire bytes of ``hlo`` over params*(N-1)/N."""
  n = plan.mesh.size
  unit = sum(e.nbytes for e in plan.entries if e.name.startswith("params/")) * (n - 1) / n
  found = traffic.collectives(hlo)
  sent = lambda ops: sum(c.wire_bytes * c.times for c in found if c.op in ops) / unit
  return sent(("all-gather",)), sent(("all-reduce", "reduce-scatter"))


def measure(config) -> dict:
  hlo, log, seconds, (mesh, plan, flops) = compile_step(config)
  n = mesh.size
  # The same blocks, computed on global arrays: the run built on the abstract mesh.
  reference = build.build(config, mesh.abstract_mesh)
  total_flops = update_flops(reference.tx, abstract(plan))
  wire, count = traffic.wire_bytes(hlo), sum(c.times for c in traffic.collectives(hlo))
  between = traffic.wire_bytes(hlo, branch=0)
  params = sum(e.nbytes for e in plan.entries if e.name.startswith("params/"))
  gathers, reductions = in_param_units(hlo, plan)
  return {
      "wire": wire,
      "between": between,
      "gathers": gathers,
      "reductions": reductions,
      "collectives": count,
      "seconds": seconds,
      "flops": flops,
      "flops_ratio": flops / max(total_flops / n, 1.0),
      "fsdp_min": 3 * params * (n - 1) / n,
      "state_ratio": plan.bytes_per_device / (reference.stored.plan.total_bytes / n),
      "remat": log.count(REMAT),
  }


@cli.command
def main(argv=None):
  parser = cli.Parser("python -m benchmarks.step_traffic", __doc__)
  parser.add_argument("--configs", default=",".join(CONFIGS), help=CONFIGS_HELP)
  parser.add_argument("--optimizers", default=",".join(OPTIMIZERS))
  parser.add_argument("--scan_layers", default="false", help="false, true or false,true")
  parser.add_argument("--axis_types", default="auto,explicit", help="auto, explicit or both")
  args = parser.parse_args(argv)
  print(
      "| config | scan | axes | optimizer | step MB/device | x adamw | between fits x adamw | x auto "
      "| x FSDP min | gathers x P | "
      "reductions x P | collectives | compile s | update GFLOP/device | "
      "x (1-device update / N) | state x ideal | remat |"
  )
  print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
  scans = [s == "true" for s in args.scan_layers.split(",")]
  auto = {}  # (config, scan, optimizer) -> the Auto row's wire bytes.
  rows = itertools.product(config_specs(args.configs), scans, args.axis_types.split(","))
  for spec, scan, axis_types in rows:
    adamw = None
    for optimizer in args.optimizers.split(","):
      config = config_for(spec, optimizer)
      config.model.scan_layers, config.mesh_axis_types = scan, axis_types
      r = measure(config)
      adamw = r["wire"] if optimizer == "adamw" else adamw
      vs_adamw = f"{r['wire'] / adamw:.2f}" if adamw else "-"
      between = f"{r['between'] / adamw:.2f}" if adamw else "-"
      key = (spec, scan, optimizer)
      auto[key] = r["wire"] if axis_types == "auto" else auto.get(key)
      vs_auto = f"{r['wire'] / auto[key]:.3f}" if auto[key] else "-"
      print(
          f"| {spec} | {scan} | {axis_types} | {optimizer} | {r['wire'] / 1e6:.1f} | "
          f"{vs_adamw} | {between} | {vs_auto} | "
          f"{r['wire'] / r['fsdp_min']:.2f} | {r['gathers']:.2f} | {r['reductions']:.2f} | "
          f"{r['collectives']} | {r['seconds']:.1f} | "
          f"{r['flops'] / 1e9:.3f} | {r['flops_ratio']:.2f} | {r['state_ratio']:.3f} | "
          f"{r['remat']} |",
          flush=True,
      )


if __name__ == "__main__":
  main()
