"""Communication read off compiled HLO: the bytes each device puts on the wire.

A plan's cost in traffic is measured, not guessed: compile the step
(``jax.jit(f).lower(...).compile().as_text()``) and count every collective with
the ring-algorithm bytes one device sends, for a collective over groups of ``g``
devices:

* all-gather: result * (g - 1) / g;
* reduce-scatter: operand * (g - 1) / g (the operand is g times the result);
* all-reduce: 2 * result * (g - 1) / g (a reduce-scatter, then an all-gather);
* all-to-all: result * (g - 1) / g;
* collective-permute: result (each device sends its whole buffer to one peer).

A collective inside a ``while`` loop's body (scanned layers, ``lax.map``) runs once
per iteration: it counts ``times`` XLA's known trip count (nested loops multiply).

Example:
  >>> import jax
  >>> from jax.sharding import NamedSharding, PartitionSpec as P
  >>> import bv_sharding as bvs
  >>> mesh = bvs.make_mesh([("data", -1)])  # 8 devices
  >>> gather = jax.jit(lambda x: x * 2, in_shardings=NamedSharding(mesh, P("data")),
  ...                  out_shardings=NamedSharding(mesh, P()))
  >>> hlo = gather.lower(jax.ShapeDtypeStruct((64, 32), "float32")).compile().as_text()
  >>> collectives(hlo)
  [Collective(op='all-gather', result_bytes=8192, group_size=8, times=1)]
  >>> wire_bytes(hlo)  # 8192 * 7 / 8
  7168.0
"""

import dataclasses
import math
import re

OPS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
_CALL = re.compile(
    r"=\s*(?P<result>\(.*?\)|\S+)\s+(?P<op>" + "|".join(OPS) + r")(?P<start>-start)?\("
)
_ARRAY = re.compile(r"\b(pred|bf16|[a-z]+\d+)\[([\d,]*)\]")
_NUM_PARTITIONS = re.compile(r"num_partitions=(\d+)")
_MESH_GROUPS = re.compile(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")
_IOTA_GROUPS = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=")
_LIST_GROUPS = re.compile(r"replica_groups=\{\{([^}]*)\}")
_COMPUTATION = re.compile(r"^(?:ENTRY )?(%[\w.\-]+) ")
_LOOP = re.compile(r"body=(%[\w.\-]+).*\"known_trip_count\":\{\"n\":\"(\d+)\"")


@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective of compiled HLO: its op, its result's bytes, its group size, and how
  many times one step runs it (a loop body's trip count, else 1)."""

  op: str
  result_bytes: int
  group_size: int
  times: int = 1

  @property
  def wire_bytes(self) -> float:
    """Bytes one device sends for it (see the module docstring for the formulas)."""
    g, result = self.group_size, self.result_bytes
    if g <= 1:
      return 0.0
    if self.op == "collective-permute":
      return float(result)
    if self.op == "reduce-scatter":
      return result * g * (g - 1) / g
    if self.op == "all-reduce":
      return 2 * result * (g - 1) / g
    return result * (g - 1) / g


def array_bytes(text: str) -> int:
  """Bytes of every array shape written in ``text`` (``f32[4,2]``, ``(bf16[8], pred[])``).

  Example:
    >>> array_bytes("(f32[4,2]{1,0}, bf16[8]{0}, pred[])")
    49
  """
  total = 0
  for dtype, dims in _ARRAY.findall(text):
    bits = 8 if dtype == "pred" else int(re.sub(r"\D", "", dtype))
    total += math.prod(int(d) for d in dims.split(",") if d) * bits // 8
  return total


def collectives(hlo: str) -> list[Collective]:
  """Every collective in compiled HLO text, in order (async ones once, at their ``-start``)."""
  devices = _NUM_PARTITIONS.search(hlo)
  everyone = int(devices.group(1)) if devices else 1
  trips = _trip_counts(hlo)
  found, computation = [], None
  for line in hlo.splitlines():
    header = _COMPUTATION.match(line)
    if header:
      computation = header.group(1)
    call = _CALL.search(line)
    if call is None:
      continue
    result = call["result"]
    if call["start"] and call["op"] in ("all-gather", "collective-permute"):
      result = result.rsplit(",", 1)[-1]  # (operand, result) tuple: the result is last
    group = _group_size(line, everyone)
    found.append(Collective(call["op"], array_bytes(result), group, trips.get(computation, 1)))
  return found


def wire_bytes(hlo: str) -> float:
  """Bytes one device sends over all collectives one run of compiled HLO text executes."""
  return sum(c.wire_bytes * c.times for c in collectives(hlo))


def _trip_counts(hlo: str) -> dict[str, int]:
  """Loop body computation -> iterations per run of the program (nested loops multiply)."""
  trips, parent, computation = {}, {}, None
  for line in hlo.splitlines():
    header = _COMPUTATION.match(line)
    if header:
      computation = header.group(1)
    loop = _LOOP.search(line)
    if loop:
      trips[loop.group(1)], parent[loop.group(1)] = int(loop.group(2)), computation
  resolved = {}
  for body, times in trips.items():
    outer = parent[body]
    while outer in trips:
      times, outer = times * trips[outer], parent[outer]
    resolved[body] = times
  return resolved


def _group_size(line: str, everyone: int) -> int:
  """Devices per replica group of one collective's HLO line; no groups means all devices."""
  mesh = _MESH_GROUPS.search(line)
  if mesh:
    sizes = {name.strip("'"): int(size) for name, size in re.findall(r"('[^']*')=(\d+)", mesh[1])}
    return math.prod(sizes[name] for name in re.findall(r"'([^']*)'", mesh[2]))
  iota = _IOTA_GROUPS.search(line)
  if iota:
    return int(iota[2])
  listed = _LIST_GROUPS.search(line)
  if listed:
    return len(listed[1].split(","))
  return everyone
