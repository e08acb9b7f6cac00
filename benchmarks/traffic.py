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
per iteration: it counts ``times`` XLA's known trip count (nested loops multiply). One inside
a branch of a ``conditional`` (``lax.cond``: branch 0 its false function, 1 its true one)
runs only on the steps that take it: it keeps the branch indices around it (``branches``),
and :func:`wire_bytes` counts every branch, or one: ``branch=0`` is a step on which every
``lax.cond`` is false (Kron between its fits), ``branch=1`` one on which each is true.

Example:
  >>> import jax
  >>> from jax.sharding import NamedSharding, PartitionSpec as P
  >>> import bv_sharding as bvs
  >>> mesh = bvs.make_mesh([("data", -1)])  # 8 devices
  >>> gather = jax.jit(lambda x: x * 2, in_shardings=NamedSharding(mesh, P("data")),
  ...                  out_shardings=NamedSharding(mesh, P()))
  >>> hlo = gather.lower(jax.ShapeDtypeStruct((64, 32), "float32")).compile().as_text()
  >>> collectives(hlo)
  [Collective(op='all-gather', result_bytes=8192, group_size=8, times=1, branches=())]
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
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_CALLED = re.compile(r"\b(?:body|condition|calls|to_apply)=(%[\w.\-]+)")
_LOOP = re.compile(r"body=(%[\w.\-]+).*\"known_trip_count\":\{\"n\":\"(\d+)\"")


@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective of compiled HLO: its op, its result's bytes, its group size, and how
  many times one step runs it (a loop body's trip count, else 1)."""

  op: str
  result_bytes: int
  group_size: int
  times: int = 1
  branches: tuple[int, ...] = ()

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
  trips, branches = _trip_counts(hlo), _branches(hlo)
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
    times, around = trips.get(computation, 1), branches.get(computation, ())
    found.append(Collective(call["op"], array_bytes(result), group, times, around))
  return found


def wire_bytes(hlo: str, branch: int | None = None) -> float:
  """Bytes one device sends over the collectives one run of compiled HLO text executes: all of
  them, or with ``branch``, those of a run that takes that branch of every conditional.

  Example:
    >>> import jax
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> import bv_sharding as bvs
    >>> rows = NamedSharding(bvs.make_mesh([("data", -1)]), P("data"))
    >>> total = jax.jit(lambda p, x: jax.lax.cond(p, lambda: x.sum(), lambda: 0.0))
    >>> x = jax.ShapeDtypeStruct((64,), "float32", sharding=rows)
    >>> hlo = total.lower(True, x).compile().as_text()
    >>> wire_bytes(hlo), wire_bytes(hlo, branch=0), wire_bytes(hlo, branch=1)  # 2 * 4 * 7 / 8
    (7.0, 0.0, 7.0)
  """
  found = collectives(hlo)
  taken = [c for c in found if branch is None or all(b == branch for b in c.branches)]
  return float(sum(c.wire_bytes * c.times for c in taken))


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


def _branches(hlo: str) -> dict[str, tuple[int, ...]]:
  """Computation -> the branch indices of the conditionals it runs in, outermost first (a
  computation a branch calls, a loop body in it, is in that branch too)."""
  parent, computation = {}, None
  for line in hlo.splitlines():
    header = _COMPUTATION.match(line)
    if header:
      computation = header.group(1)
      continue
    listed = _BRANCHES.search(line)
    for index, called in enumerate(re.findall(r"%[\w.\-]+", listed[1]) if listed else ()):
      parent[called] = (computation, (index,))
    for called in _CALLED.findall(line):
      parent.setdefault(called, (computation, ()))
  resolved = {}
  for called in parent:
    around, outer = (), called
    while outer in parent:
      outer, index = parent[outer]
      around = index + around
    resolved[called] = around
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
