r"""Plans a config's params and optimizer state on any mesh, before anything is allocated.

  python -m trainers.plan --config configs/lm_7b_pod.py --mesh '[("data", 64), ("model", 4)]'
  python -m trainers.plan --config configs/lm_7b_pod.py --config.optax_name=kron \
      --format json --png plan.png --max_unsharded_fraction 0.02
  python -m trainers.plan --config configs/lm_7b_pod.py --diff config.optax_name=kron \
      --diff 'mesh=[("data", 32), ("model", 8)]'

The devices need not exist: the plan is made on an ``AbstractMesh`` of ``--num_devices``
(default ``config.num_devices``, else the mesh's own size, else this host's devices)
from the model and optimizer the trainer would build (``trainers/build.py``),
traced with ``jax.eval_shape``. It prints:

* one row per leaf (name, shape, dtype, storage spec, compute spec, MiB per device, why),
  the leaves with the most unsharded bytes first (see ``bvs.Plan.unsharded_bytes``); the
  compute spec is the layout a param is gathered to where it is used under Explicit axes
  (the storage spec less its storage-only axes; optimizer state's is its storage spec);
* per-device totals for params, gradients (the params' specs) and optimizer state,
  and the largest per-device tensor;
* the coverage (bytes-weighted share of the full split over every mesh axis),
  strategy entries that claimed no leaf and leaves no entry claimed.

``--compile`` (not with ``--diff``) also compiles the train step on this host's devices (on
CPU the trainer's simulated ones: ``$BV_DEVICES_PER_PROCESS``, default 8) from abstract
inputs and prints XLA's figures per device (arguments, temporaries, outputs, aliased)
against each device's memory (``config.device_memory_gib`` or the devices';
``trainers/figures/memory.py``), the check the trainer makes before init, and the step's model FLOPs
as the trainer logs them (``trainers/figures/utilization.py``; the same scanned or not); JSON: the
``compiled`` key. ``--dcn_mesh`` overrides ``config.dcn_mesh`` (a multi-slice pod: each axis
``ici * dcn`` long).
``--format json`` prints the same as JSON; ``--png FILE`` draws per-device memory by
component and the largest leaves (``pip install -e ".[plot]"``); ``--diff OVERRIDE``
(repeatable) plans a second time with the overrides added (e.g. ``config.optax_name=kron``
or ``'mesh=[("data", 32), ("model", 8)]'``; leading dashes optional) and prints only
what changes; ``--max_unsharded_fraction F`` exits 1 naming the five least sharded
leaves when more than F of the bytes is unsharded. A bad input (a flag, a config, a mesh)
ends as one line, ``ConfigError: ...``, with exit status 1 (``--debug``: the traceback).
"""

import argparse
import ast
import dataclasses
import json
import math
import sys

import jax
import numpy as np

import bv_sharding as bvs
from trainers import MiB, build
from trainers.errors import ConfigError
from trainers.figures import memory, utilization
from trainers.hosts import distributed
from trainers.settings import cli, schema

PARAMS = "params"
COMPONENTS = ("params", "gradients", "optimizer_state")
GATE_FAILED = 1


@dataclasses.dataclass(frozen=True)
class Setup:
  """One plan's inputs: the config, the mesh's (and across slices) pairs, the device count, the
  arguments."""

  config: object
  mesh: tuple
  dcn_mesh: tuple
  num_devices: int
  args: tuple[str, ...]


def parser() -> cli.Parser:
  """The command's own options; ``--config`` and ``--config.key=value`` go to ml_collections."""
  p = cli.Parser("python -m trainers.plan", __doc__)
  p.add_argument("--mesh", help='overrides config.mesh, e.g. \'[("data", 64), ("model", 4)]\'')
  p.add_argument("--dcn_mesh", help="overrides config.dcn_mesh (across TPU slices)")
  p.add_argument("--num_devices", type=int, help="devices to plan for (sizes -1 axes)")
  p.add_argument("--format", choices=("text", "json"), default="text")
  p.add_argument(
      "--png", type=cli.new_file, help="draw per-device memory and the largest leaves to this file"
  )
  p.add_argument(
      "--diff",
      action="append",
      help="an override for a second plan (repeat for more); print only what changes",
  )
  p.add_argument("--max_unsharded_fraction", type=cli.fraction, help="exit 1 above this fraction")
  p.add_argument("--rows", type=int, help="print only this many leaf rows (default: all)")
  p.add_argument(
      "--compile",
      action="store_true",
      help="also compile the train step on this host's devices (CPU: as many simulated as "
      "trainers.train's, $BV_DEVICES_PER_PROCESS or 8) and print its memory per device",
  )
  return p


def setup(options, config_args, loaded=None) -> Setup:
  """Resolves the config, the mesh (``--mesh`` wins over ``config.mesh``) and the device count;
  ``loaded``: the config file's config, loaded already (``cli.load_config``)."""
  config = cli.config_from_args(config_args, loaded)  # build() resolves vocab, dtype.
  config = schema.of(config)
  mesh = config.mesh if options.mesh is None else parse_mesh(options.mesh, "--mesh")
  dcn = config.dcn_mesh or ()
  dcn = dcn if options.dcn_mesh is None else parse_mesh(options.dcn_mesh, "--dcn_mesh")
  num_devices = (
      options.num_devices or _fixed_size([*mesh, *dcn]) or config.num_devices or jax.device_count()
  )
  given = [(flag, v) for flag, v in (("--mesh", options.mesh), ("--dcn_mesh", options.dcn_mesh))]
  args = (*config_args, *(f"{flag}={v}" for flag, v in given if v))
  return Setup(config, tuple(mesh), tuple(dcn), num_devices, args)


def parse_mesh(text: str, flag: str) -> tuple:
  """``--mesh`` (or ``--dcn_mesh``) as a literal list of ``(name, size)`` pairs, never evaluated."""
  try:
    return tuple(ast.literal_eval(text))
  except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
    raise ConfigError(
        f"{flag} {text!r} is not a literal list of (axis_name, size) pairs, e.g. "
        '\'[("data", 64), ("model", 4)]\''
    ) from None


def make_plan(s: Setup) -> bvs.Plan:
  """The trainer's plan of ``s.config`` on an abstract mesh of ``s.num_devices``; no arrays."""
  mesh = bvs.make_abstract_mesh(
      s.mesh, s.num_devices, dcn_mesh=s.dcn_mesh, axis_types=build.axis_types(s.config)
  )
  return build.build(s.config, mesh).plan


def compiled(s: Setup) -> dict:
  """The compiled train step's memory per device on this host's devices, against each
  device's memory (``trainers/figures/memory.py``): what the trainer checks before init; and its
  model FLOPs as the trainer counts them (``trainers/figures/utilization.py``).

  The devices must exist: ``s.num_devices`` of them (on CPU, the simulated ones).
  """
  devices = jax.devices()
  if len(devices) < s.num_devices:
    raise ConfigError(
        f"--compile: the mesh {list(s.mesh)} needs {s.num_devices} devices but this host has "
        f"{len(devices)} ({devices[0].platform}; CPU devices simulated: $BV_DEVICES_PER_PROCESS); "
        f"compile where they exist, or plan for these with --num_devices={len(devices)} or --mesh"
    )
  devices = devices[: s.num_devices]
  mesh = bvs.make_mesh(
      s.mesh, dcn_mesh=s.dcn_mesh, devices=devices, axis_types=build.axis_types(s.config)
  )
  run = build.build(s.config, mesh)
  step = build.compile_step(run)
  have = memory.budget(devices, run.config.device_memory_gib)
  cost = utilization.step_cost(run, run.config, step.batch_sharding, run.batch_shapes)
  return {
      "devices": f"{len(devices)} {devices[0].device_kind}",
      "grad_accum_steps": run.config.grad_accum_steps,
      "flops_per_step": cost.flops,
      "flops_source": cost.source,
      **memory.report(step.figures, have),
  }


def report(s: Setup, plan: bvs.Plan) -> dict:
  """Everything the command prints, as plain data (the JSON output)."""
  rows = sorted(
      (_row(plan, e) for e in plan.entries),
      key=lambda r: (-r["unsharded_bytes"], -r["bytes_per_device"], r["name"]),
  )
  per_device = {c: 0 for c in COMPONENTS}
  for r in rows:
    per_device[r["component"]] += r["bytes_per_device"]
  per_device["gradients"] = per_device["params"]
  total = sum(per_device.values())
  everything = sum(r["bytes"] for r in rows) + sum(r["bytes"] for r in rows if _is_param(r))
  unused, unclaimed = plan.claims()
  return {
      "args": list(s.args),
      "optimizer": s.config.optax_name,
      "mesh": dict(plan.mesh.shape),
      "num_devices": plan.num_devices,
      "per_device": {**per_device, "total": total, "ideal": everything / plan.num_devices},
      "largest": max(rows, key=lambda r: r["bytes_per_device"]),
      "coverage": plan.coverage,
      "unsharded_fraction": 1 - plan.coverage,
      "unused_strategy_entries": [list(pair) for pair in unused],
      "unclaimed_leaves": unclaimed,
      "leaves": rows,
  }


def text(rep: dict, rows: int | None = None) -> str:
  """The report as a table and summary lines."""
  shown = rep["leaves"][:rows]
  table = [("name", "shape", "dtype", "spec", "compute_spec", "MiB/device", "why")]
  table += [
      (
          r["name"],
          str(tuple(r["shape"])),
          r["dtype"],
          _spec(r["spec"]),
          _spec(r["compute_spec"]),
          f"{r['bytes_per_device'] / MiB:.3f}",
          r["why"],
      )
      for r in shown
  ]
  widths = [max(len(t[i]) for t in table) for i in range(6)]
  lines = ["  ".join(c.ljust(w) for c, w in zip(t[:6], widths)) + "  " + t[6] for t in table]
  if len(shown) < len(rep["leaves"]):
    lines.append(f"... {len(rep['leaves']) - len(shown)} more leaves (--rows)")
  d, big = rep["per_device"], rep["largest"]
  lines += [
      f"mesh {rep['mesh']} ({rep['num_devices']} devices), optimizer {rep['optimizer']}, "
      f"{len(rep['leaves'])} leaves",
      "per device: "
      + ", ".join(f"{c.replace('_', ' ')} {d[c] / MiB:.1f} MiB" for c in COMPONENTS)
      + f", total {d['total'] / MiB:.1f} MiB ({d['total'] / max(d['ideal'], 1):.3f}x the ideal "
      f"{d['ideal'] / MiB:.1f} MiB)",
      f"largest per-device tensor: {big['name']} {tuple(big['shape'])} {_spec(big['spec'])} "
      f"{big['bytes_per_device'] / MiB:.1f} MiB",
      f"coverage: {100 * rep['coverage']:.2f}% of the {rep['num_devices']}-way split "
      f"(unsharded fraction {rep['unsharded_fraction']:.4f})",
      "strategy entries that claimed no leaf: "
      + (", ".join(f"({r!r}, {c!r})" for r, c in rep["unused_strategy_entries"]) or "none"),
      "leaves claimed by no entry: " + (", ".join(rep["unclaimed_leaves"]) or "none"),
  ]
  if "compiled" in rep:
    lines.append(compiled_text(rep["compiled"]))
  return "\n".join(lines)


def compiled_text(c: dict) -> str:
  """The compiled step's lines: its model FLOPs; its figures per device, and whether it fits."""
  flops = f"model FLOPs per step: {c['flops_per_step']:.6g} ({c['flops_source']})\n"
  return flops + _memory_text(c)


def _memory_text(c: dict) -> str:
  head = f"compiled train step on {c['devices']} (grad_accum_steps={c['grad_accum_steps']}): "
  if c["per_device"] is None:
    return head + "the backend gives no memory figures"
  figures = ", ".join(
      f"{k} {c['per_device'][k] / MiB:.1f} MiB"
      for k in ("arguments", "temporaries", "outputs", "aliased")
  )
  total = f"total {c['per_device']['total'] / MiB:.1f} MiB per device"
  if c["fits"] is None:
    return f"{head}{figures}; {total}; {c['where']}"
  fits = "fits" if c["fits"] else "does NOT fit"
  return f"{head}{figures}; {total} of {c['device_memory'] / MiB:.1f} MiB ({c['where']}): {fits}"


def diff(a: dict, b: dict) -> dict:
  """What changes from report ``a`` to report ``b``: mesh, totals, coverage and leaves."""
  keys = ("shape", "dtype", "spec", "bytes_per_device")
  rows_a = {r["name"]: r for r in a["leaves"]}
  rows_b = {r["name"]: r for r in b["leaves"]}
  pick = lambda r: {k: r[k] for k in ("name", *keys)}
  return {
      "a": a["args"],
      "b": b["args"],
      "summary": {
          k: [a[k], b[k]] for k in ("mesh", "optimizer", "unsharded_fraction") if a[k] != b[k]
      },
      "per_device": {
          k: [a["per_device"][k], b["per_device"][k]]
          for k in a["per_device"]
          if a["per_device"][k] != b["per_device"][k]
      },
      "changed": [
          {"name": n, "a": pick(rows_a[n]), "b": pick(rows_b[n])}
          for n in rows_a
          if n in rows_b and any(rows_a[n][k] != rows_b[n][k] for k in keys)
      ],
      "only_a": [pick(r) for n, r in rows_a.items() if n not in rows_b],
      "only_b": [pick(r) for n, r in rows_b.items() if n not in rows_a],
  }


def diff_text(d: dict) -> str:
  """The diff, one line per change."""
  leaf = lambda r: (
      f"{r['name']} {tuple(r['shape'])} {r['dtype']} {_spec(r['spec'])} "
      f"{r['bytes_per_device'] / MiB:.3f} MiB"
  )
  lines = [f"A: {' '.join(d['a'])}", f"B: {' '.join(d['b'])}"]
  lines += [f"{k}: {x} -> {y}" for k, (x, y) in d["summary"].items()]
  lines += [
      f"{k.replace('_', ' ')} MiB/device: {x / MiB:.1f} -> {y / MiB:.1f}"
      for k, (x, y) in d["per_device"].items()
  ]
  for c in d["changed"]:
    a, b = c["a"], c["b"]
    lines.append(
        f"~ {c['name']}: {tuple(a['shape'])} {a['dtype']} {_spec(a['spec'])} "
        f"{a['bytes_per_device'] / MiB:.3f} MiB -> {tuple(b['shape'])} {b['dtype']} "
        f"{_spec(b['spec'])} {b['bytes_per_device'] / MiB:.3f} MiB"
    )
  lines += [f"- {leaf(r)}" for r in d["only_a"]] + [f"+ {leaf(r)}" for r in d["only_b"]]
  lines.append(
      f"{len(d['changed'])} leaves changed, {len(d['only_a'])} only in A, "
      f"{len(d['only_b'])} only in B"
  )
  return "\n".join(lines)


def draw(rep: dict, path: str, largest: int = 12) -> None:
  """Per-device memory by component next to the ideal, and the largest per-device leaves."""
  try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    raise ConfigError('--png needs matplotlib: pip install -e ".[plot]"') from None
  d = rep["per_device"]
  colors = {"params": "tab:blue", "gradients": "tab:orange", "optimizer_state": "tab:green"}
  fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4), width_ratios=(1, 2.4))
  bottom = 0.0
  for c in COMPONENTS:
    left.bar([0], [d[c] / MiB], width=0.6, bottom=bottom, color=colors[c], label=c)
    bottom += d[c] / MiB
  left.axhline(d["ideal"] / MiB, color="black", linestyle="--", label="ideal (total / N)")
  left.set(xlim=(-0.5, 1.9), xticks=[0], xticklabels=["per device"], ylabel="MiB")
  left.set_title(f"{rep['optimizer']} on {rep['mesh']}", fontsize=9)
  left.legend(fontsize=7, loc="upper right")
  top = sorted(rep["leaves"], key=lambda r: -r["bytes_per_device"])[:largest][::-1]
  right.barh(
      [r["name"][-48:] for r in top],
      [r["bytes_per_device"] / MiB for r in top],
      color=[colors[r["component"]] for r in top],
  )
  right.set_xlabel("MiB per device")
  right.set_title(f"{largest} largest leaves per device", fontsize=9)
  right.tick_params(axis="y", labelsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=72)
  plt.close(fig)


@cli.command
def main(argv: list[str] | None = None) -> int:
  """Runs the command; returns the exit status (0, or 1: gate failed; a bad input exits 1)."""
  p = parser()
  options, config_args = p.parse_known_args(argv)
  if options.compile:
    simulate_devices()
  loaded = cli.load_config(cli.config_spec(config_args))  # The file runs once, for both.
  first = setup(options, config_args, loaded)
  rep = report(first, plan := make_plan(first))
  if options.diff:
    extra = [a if a.startswith("-") else f"--{a}" for a in options.diff]
    more, more_config = p.parse_known_args(extra, argparse.Namespace(**vars(options)))
    second = setup(more, [*config_args, *more_config], loaded)
    d = diff(rep, report(second, make_plan(second)))
    print(json.dumps(d, indent=1) if options.format == "json" else diff_text(d))
    return 0
  if options.compile:
    rep["compiled"] = compiled(first)
  print(json.dumps(rep, indent=1) if options.format == "json" else text(rep, options.rows))
  if options.png:
    draw(rep, options.png)
  return gate(plan, options.max_unsharded_fraction)


def simulate_devices() -> None:
  """On the CPU backend, as many simulated devices as ``trainers.train`` has; before the
  backend starts (a started one keeps its devices)."""
  wanted = distributed.simulated_devices()
  if jax.config.jax_num_cpu_devices != wanted:
    jax.config.update("jax_num_cpu_devices", wanted)


def gate(plan: bvs.Plan, limit: float | None) -> int:
  """0, or 1 with the five least sharded leaves on stderr when coverage misses ``limit``."""
  if limit is None:
    return 0
  try:
    bvs.check_coverage(plan, limit)
  except bvs.ShardingError as e:
    print(f"trainers.plan: coverage gate failed: {e}", file=sys.stderr)
    return GATE_FAILED
  return 0


def _row(plan: bvs.Plan, e: bvs.Entry) -> dict:
  return {
      "name": e.name,
      "component": PARAMS if e.name.split("/")[0] == PARAMS else "optimizer_state",
      "shape": list(e.shape),
      "dtype": np.dtype(e.dtype).name,
      "spec": _spec_json(e.spec),
      "compute_spec": _spec_json(e.compute_spec),
      "bytes": e.nbytes,
      "bytes_per_device": e.bytes_per_device,
      "pieces": plan.pieces(e),
      "unsharded_bytes": plan.unsharded_bytes(e),
      "why": e.why,
  }


def _fixed_size(pairs) -> int | None:
  """The devices ``(name, size)`` pairs cover when every size is given, else None (a -1, a typo)."""
  sizes = [p[1] if isinstance(p, (tuple, list)) and len(p) == 2 else None for p in pairs]
  ok = sizes and all(isinstance(n, int) and n > 0 for n in sizes)
  return math.prod(sizes) if ok else None


def _is_param(row: dict) -> bool:
  return row["component"] == PARAMS


def _spec_json(spec) -> list:
  return [list(a) if isinstance(a, tuple) else a for a in spec]


def _spec(spec: list) -> str:
  return "P(" + ", ".join(repr(tuple(a) if isinstance(a, list) else a) for a in spec) + ")"


if __name__ == "__main__":
  sys.exit(main())
