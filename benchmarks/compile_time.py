"""Compile time: the trainer's train step per optimizer, jax's persistent cache off.

For each config the trainer's train step (``trainers/build.py``'s ``compile_step``: its plan,
optimizer and param layout) is traced, lowered and compiled on 8 simulated devices, never
run, with jax's persistent compilation cache off and its in-memory caches cleared before
each compile, so every optimizer pays its whole compile. The optimizers alternate over
``--rounds`` rounds (adamw, kron, shampoo, muon, adamw, ...) so a loaded host slows each
alike; a row gives the median seconds of tracing and lowering, of XLA's compile and their
sum, the process's CPU seconds for that sum (``time.process_time``: every thread of the
process, and little changed by other processes on a shared host), those CPU seconds over
adamw's in the same round (the median of the rounds' ratios, ± their standard deviation: the
noise of one round), the least CPU seconds of its rounds over adamw's least (a shared host's
noise only adds time, so the least of several rounds is the nearest to the compile's own cost,
as ``timeit`` reports), and the compiled program's instruction count (``as_text()``;
noise-free, and what compile time grows with).

With ``--kernels`` each compile is traced (``jax.profiler``) and two more columns say where
XLA:CPU's time went: the kernels it compiled (its fused computations, each on its own)
and the seconds it spent on them, emitting each fusion and LLVM compiling them
(:func:`kernel_profile`). The trace adds its own time to the other columns: compare the
optimizers of one run.

  python -m benchmarks.compile_time [--configs lm:size=small,lm:size=medium] \
      [--optimizers adamw,kron,shampoo,muon] [--rounds 2] [--kernels] [--devices 8] \
      [--scan_layers true|false]
"""

import os

from trainers import ONE_BLAS_THREAD

os.environ.setdefault(*ONE_BLAS_THREAD)  # Before numpy loads OpenBLAS (trainers/__init__.py).

import contextlib
import pathlib
import re
import statistics
import tempfile
import time

import jax

jax.config.update("jax_num_cpu_devices", 8)

import flax.linen as nn  # noqa: E402

import bv_sharding as bvs  # noqa: E402
from benchmarks.step_traffic import CONFIGS_HELP, config_for, config_specs  # noqa: E402
from trainers import build, steps  # noqa: E402
from trainers.settings import cli  # noqa: E402

CONFIGS = ("lm:size=small", "lm:size=medium")
OPTIMIZERS = ("adamw", "kron", "shampoo", "muon")


def instructions(hlo: str) -> int:
  """The instructions of an HLO module's text: its lines that assign a value.

  Example:
      >>> instructions("ENTRY %main {\\n  %p = f32[] parameter(0)\\n  ROOT %n = f32[] negate(%p)\\n}")
      2
  """
  return sum(" = " in line for line in hlo.splitlines())


def kernels(hlo: str) -> int:
  """The distinct fused computations of compiled HLO text, names and metadata aside: the
  kernels XLA compiles (one per distinct body; like fusions share one), noise-free.

  Example:
      >>> step = jax.jit(lambda a, b: (a * 2 + 1, b * 2 + 1))  # Two fusions, one body.
      >>> x = jax.numpy.ones(4)
      >>> kernels(step.lower(x, x).compile().as_text())
      1
  """
  bodies = re.split(r"\n(?=\S)", hlo)
  fused = [b for b in bodies if re.match(r"%?(fused|wrapped)\S* ", b)]
  strip = lambda body: re.sub(r"%[\w.\-]+|, metadata=\{[^}]*\}", "", body.split("\n", 1)[-1])
  return len({strip(body) for body in fused})


# The profiler's events of XLA:CPU compiling kernels: one per fused computation emitted, and
# LLVM's compile of them all. Only XLA:CPU's fusion emitters (its default) report the first, so
# a compile profiled for its kernels asks for them (``FUSION_EMITTERS``), whatever XLA_FLAGS say
# (the tests turn them off to compile faster: tests/conftest.py).
FUSION_EVENT, CODEGEN_EVENT = "FusionCompiler::Compile", "JitCompiler::Compile"
FUSION_EMITTERS = {"xla_cpu_use_fusion_emitters": True}


@contextlib.contextmanager
def kernel_profile():
  """Yields a dict that gets, when the block ends, the kernels XLA:CPU compiled in it
  (``"kernels"``) and the seconds it spent on them (``"kernel_s"``: emitting the fusions and
  LLVM's compile), read from a ``jax.profiler`` trace of the block.

  Example:
      >>> with kernel_profile() as profile:
      ...   _ = jax.jit(lambda x: jax.numpy.sin(x) * 2).lower(1.0).compile(FUSION_EMITTERS)
      >>> profile["kernels"] >= 1 and profile["kernel_s"] > 0
      True
  """
  profile = {}
  with tempfile.TemporaryDirectory() as directory:
    with jax.profiler.trace(directory):
      yield profile
    [path] = pathlib.Path(directory).rglob("*.xplane.pb")
    data = jax.profiler.ProfileData.from_file(str(path))
    events = [e for plane in data.planes for line in plane.lines for e in line.events]
  profile["kernels"] = sum(e.name == FUSION_EVENT for e in events)
  seconds = [e.duration_ns for e in events if e.name in (FUSION_EVENT, CODEGEN_EVENT)]
  profile["kernel_s"] = sum(seconds) / 1e9


def compile_once(config, kernels: bool = False) -> dict:
  """Seconds to trace and lower, and to compile, the trainer's step of ``config``; the
  compiled program's instruction count; with ``kernels``, :func:`kernel_profile`'s figures."""
  jax.clear_caches()
  mesh = bvs.make_mesh(config.mesh, axis_types=build.axis_types(config))
  run = build.build(config, mesh)
  sharding, jitted = build.jit_step(run)
  batch = steps.abstract_batch(run.batch_shapes, sharding)
  with jax.set_mesh(mesh), nn.logical_axis_rules(config.sharding_rules):
    start, cpu = time.perf_counter(), time.process_time()
    lowered = jitted.lower(run.plan.abstract(), batch)
    lowered_at = time.perf_counter()
    with kernel_profile() if kernels else contextlib.nullcontext({}) as profile:
      compiled = lowered.compile(FUSION_EMITTERS if kernels else None)
    done = time.perf_counter()
  return {
      **profile,
      "lower": lowered_at - start,
      "compile": done - lowered_at,
      "total": done - start,
      "cpu": time.process_time() - cpu,
      "instructions": instructions(compiled.as_text()),
  }


def rounds(
    spec: str, optimizers: list[str], count: int, kernels: bool = False, scan: bool | None = None
) -> dict[str, list[dict]]:
  """Per optimizer, its :func:`compile_once` of each round, the optimizers alternating;
  each with its ``ratio``: CPU seconds over the same round's first optimizer's. ``scan``: the
  model's ``scan_layers`` (None: as configured)."""
  out = {name: [] for name in optimizers}
  for _ in range(count):
    first = None
    for name in optimizers:
      config = config_for(spec, name)
      if scan is not None:
        config.model.scan_layers = scan
      r = compile_once(config, kernels)
      first = first or r["cpu"]
      out[name].append({**r, "ratio": r["cpu"] / first})
  return out


def row(spec: str, name: str, measured: list[dict], base_least: float) -> str:
  """One table row: the medians over the rounds (the ratio's ± the rounds' standard deviation),
  and the least CPU seconds over ``base_least`` (the base optimizer's least)."""
  median = lambda key: statistics.median(r[key] for r in measured)
  least = min(r["cpu"] for r in measured) / base_least
  spread = statistics.pstdev(r["ratio"] for r in measured)
  cells = (
      f"| {spec} | {name} | {median('lower'):.1f} | {median('compile'):.1f} | "
      f"{median('total'):.1f} | {median('cpu'):.1f} | {median('ratio'):.2f} ± {spread:.2f} | "
      f"{least:.2f} | "
      f"{measured[0]['instructions']} |"
  )
  if "kernels" in measured[0]:
    cells += f" {measured[0]['kernels']} | {median('kernel_s'):.1f} |"
  return cells


@cli.command
def main(argv=None):
  parser = cli.Parser("python -m benchmarks.compile_time", __doc__)
  parser.add_argument("--configs", default=",".join(CONFIGS), help=CONFIGS_HELP)
  parser.add_argument("--optimizers", default=",".join(OPTIMIZERS), help="the first: the base")
  parser.add_argument("--rounds", type=int, default=2)
  parser.add_argument("--kernels", action="store_true", help="profile the kernels compiled")
  parser.add_argument(
      "--devices", type=int, default=8, help="simulated devices (1: no collective at all)"
  )
  parser.add_argument(
      "--scan_layers",
      default="",
      help="true or false: the model's scan_layers (default: the config's)",
  )
  args = parser.parse_args(argv)
  # Here, not on import: the tests import this module and keep their shared cache (and
  # their devices: jax starts its backend on the first compile, after this).
  jax.config.update("jax_enable_compilation_cache", False)
  jax.config.update("jax_num_cpu_devices", args.devices)
  optimizers = args.optimizers.split(",")
  extra = " kernels | kernel s |" if args.kernels else ""
  print(
      f"| config | optimizer | trace+lower s | XLA compile s | total s | CPU s | "
      f"CPU x {optimizers[0]} | least CPU x {optimizers[0]} | instructions |{extra}"
  )
  print("|---|---|---|---|---|---|---|---|---|" + "---|" * (2 if args.kernels else 0))
  scan = {"": None, "true": True, "false": False}[args.scan_layers]
  for spec in config_specs(args.configs):
    label = spec if scan is None else f"{spec} (scan_layers={args.scan_layers})"
    measured = rounds(spec, optimizers, args.rounds, args.kernels, scan)
    least = min(r["cpu"] for r in measured[optimizers[0]])
    for name, runs in measured.items():
      print(row(label, name, runs, least), flush=True)


if __name__ == "__main__":
  main()
