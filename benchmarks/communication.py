"""Communication benchmark: collective bytes per device of one jitted optimizer update.

Params and grads are sharded by each placement (``benchmarks/placements.py``), the
update is compiled for 8 simulated CPU devices and the collectives are read off the
compiled HLO; the state bytes per device are printed next to them. Model: a small
Llama (V=8192, C=512, F=2048, 2 unscanned layers); Shampoo-style blocks of 128, Kron
blocks of 256 (the registry's default).

  python -m benchmarks.communication [--optimizers kron,psgd_kron]
"""

import argparse
import os
import re

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import jax

jax.config.update("jax_num_cpu_devices", 8)

import optax  # noqa: E402

import bv_sharding as bvs  # noqa: E402
from benchmarks import placements  # noqa: E402
from tests import zoo  # noqa: E402

MB = 1e6
SECOND_ORDER = {
    "psgd_kron",
    "distributed_shampoo",
    "tearfree_layout",
    "kron",
    "kron_blocks",
    "shampoo",
}
COLLECTIVE = re.compile(
    r"=\s*(\(.*?\)|\S+)\s+(all-gather|all-reduce|reduce-scatter|all-to-all|"
    r"collective-permute)(-done)?\("
)
ARRAY = re.compile(r"(pred|[suf]\d+|bf16)\[([\d,]*)\]")
BITS = {"pred": 8, "bf16": 16}


def collective_bytes(hlo: str) -> int:
  """Bytes of every collective's result in partitioned HLO: what one device receives."""
  total = 0
  for line in hlo.splitlines():
    found = COLLECTIVE.search(line)
    if found and "-start" not in line.split("=")[1].split("(")[0]:
      total += sum(_bytes(dtype, dims) for dtype, dims in ARRAY.findall(found.group(1)))
  return total


GROUPS = re.compile(r"replica_groups=(\{\{[\d,]*\}[^ ]*\}|\[\d+,(\d+)\]<=\[[\d,]+\][^ ,]*)")
WIRE = {"all-gather": 1, "all-reduce": 2, "all-to-all": 1}


LOOP = re.compile(r"body=(%[\w.\-]+).*\"known_trip_count\":\{\"n\":\"(\d+)\"")
COMPUTATION = re.compile(r"^(?:ENTRY )?(%[\w.\-]+) ")


def wire_bytes(hlo: str, num_devices: int) -> tuple[int, int]:
  """(wire bytes per device, number of collectives executed) of compiled HLO.

  all-gather result*(g-1)/g, reduce-scatter operand*(g-1)/g (= result*(g-1)),
  all-reduce 2*result*(g-1)/g, all-to-all result*(g-1)/g, collective-permute result;
  g is the replica group size. A collective in a while loop's body (scanned layers)
  counts once per iteration (XLA's known trip count).

  Example:
    >>> wire_bytes("%x = f32[8]{0} all-gather(f32[2]{0} %p), replica_groups=[2,4]<=[8]", 8)
    (24, 1)
  """
  trips = _trip_counts(hlo)
  total = count = 0
  computation = None
  for line in hlo.splitlines():
    header = COMPUTATION.match(line)
    if header:
      computation = header.group(1)
    found = COLLECTIVE.search(line)
    if not found or found.group(3):  # the -done half of an async pair
      continue
    times = trips.get(computation, 1)
    result = sum(_bytes(*a) for a in ARRAY.findall(found.group(1)))
    g = _group_size(line, num_devices)
    op = found.group(2)
    if op == "reduce-scatter":
      total += times * result * (g - 1)
    elif op == "collective-permute":
      total += times * result
    else:
      total += times * (WIRE[op] * result * (g - 1) // g)
    count += times
  return total, count


def _trip_counts(hlo: str) -> dict[str, int]:
  """Loop body computation -> iterations (nested loops multiply)."""
  trips, parent = {}, {}
  computation = None
  for line in hlo.splitlines():
    header = COMPUTATION.match(line)
    if header:
      computation = header.group(1)
    loop = LOOP.search(line)
    if loop:
      trips[loop.group(1)] = int(loop.group(2))
      parent[loop.group(1)] = computation
  resolved = {}
  for body in trips:
    times, outer = trips[body], parent[body]
    while outer in trips:
      times, outer = times * trips[outer], parent[outer]
    resolved[body] = times
  return resolved


def _group_size(line: str, num_devices: int) -> int:
  found = GROUPS.search(line)
  if not found:
    return num_devices
  if found.group(2):
    return int(found.group(2))
  first = found.group(1)[2:].split("}")[0]
  return len(first.split(",")) if first else num_devices


def _bytes(dtype: str, dims: str) -> int:
  size = 1
  for d in filter(None, dims.split(",")):
    size *= int(d)
  return size * BITS.get(dtype, int(dtype[1:]) if dtype[1:].isdigit() else 32) // 8


def update_traffic(tx, params_shape, opt_shape, placement) -> int:
  def update(params, opt, grads):
    updates, opt = tx.update(grads, opt, params)
    return optax.apply_updates(params, updates), opt

  step = jax.jit(
      update,
      in_shardings=(placement.params, placement.opt, placement.params),
      out_shardings=(placement.params, placement.opt),
  )
  return collective_bytes(step.lower(params_shape, opt_shape, params_shape).compile().as_text())


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--optimizers", default="", help="comma-separated subset of tests/zoo.py")
  args = parser.parse_args()
  params = zoo.llama_params(d=512, vocab=8192, ff=2048)
  params = {
      "embed": params["embed"],
      "layers_0": params["block"],
      "layers_1": params["block"],
      "final_norm": params["final_norm"],
      "head": params["head"],
  }
  mesh = bvs.make_mesh([("data", -1)])
  chosen = [n for n in args.optimizers.split(",") if n]
  print("| optimizer | placement | update traffic MB/device | state MB/device |")
  print("|---|---|---|---|")
  for name, tx in zoo.optimizers(params, block_size=128).items():
    if chosen and name not in chosen:
      continue
    opt = jax.eval_shape(tx.init, params)
    for label, placement in placements.placements(params, opt, mesh, name in SECOND_ORDER).items():
      traffic = update_traffic(tx, params, opt, placement)
      state = placement.state_bytes_per_device("opt")
      print(f"| {name} | {label} | {traffic / MB:.1f} | {state / MB:.1f} |", flush=True)


if __name__ == "__main__":
  main()
