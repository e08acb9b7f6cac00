"""How much of a plan the mesh covers, and the gate on it.

Mesh coverage is :attr:`bv_sharding.Plan.coverage`: each leaf's bytes weighted by
``pieces / devices``, so a leaf counts as fully sharded only when its spec splits
it over every mesh axis. The *unsharded fraction* is ``1 - coverage``, and a
leaf's *unsharded bytes* (:meth:`bv_sharding.Plan.unsharded_bytes`) are
``nbytes * (1 - pieces / devices)``: what the mesh could still take off each
device. :func:`check_coverage` is the gate (MaxText's "five largest unsharded
tensors" check) to call before allocating. Which strategy entries claimed no leaf
is :meth:`bv_sharding.Plan.claims`.

Example:
  >>> import jax
  >>> import bv_sharding as bvs
  >>> tree = {"w": jax.ShapeDtypeStruct((1024, 1024), "float32"),
  ...         "b": jax.ShapeDtypeStruct((1024,), "float32")}
  >>> strategy = [("w", 'fsdp(axis="data", min_size_to_shard_mb=0)'), ("b", "replicate()")]
  >>> plan = bvs.plan(tree, strategy, bvs.make_abstract_mesh([("data", 8)], 8))
  >>> round(unsharded_fraction(plan), 4)
  0.0009
  >>> [e.name for e in least_sharded(plan)]
  ['b']
  >>> check_coverage(plan, 0.01)
  >>> check_coverage(plan, 0.0001)
  Traceback (most recent call last):
  ...
  bv_sharding.errors.ShardingError: 0.0854% of the planned bytes are not split over the whole mesh ...
"""

from bv_sharding.aliases import deprecated as _deprecated
from bv_sharding.errors import ShardingError
from bv_sharding.planning import Entry, Plan
from bv_sharding.specs import MiB

NAMED_IN_ERRORS = 5


def unsharded_fraction(plan: Plan) -> float:
  """``1 - plan.coverage``: the bytes-weighted share of the ideal split not achieved."""
  return 1 - plan.coverage


def least_sharded(plan: Plan, count: int | None = None) -> list[Entry]:
  """Entries not split over the whole mesh, most unsharded bytes first (``count`` of them)."""
  short = [e for e in plan.entries if plan.unsharded_bytes(e) > 0]
  short.sort(key=lambda e: (-plan.unsharded_bytes(e), e.name))
  return short[:count]


def check_coverage(plan: Plan, max_unsharded_fraction: float) -> None:
  """Raises ``ShardingError`` naming the five least sharded leaves when more than
  ``max_unsharded_fraction`` (a number in [0, 1], e.g. 0.02) of the plan's bytes is unsharded."""
  if not isinstance(max_unsharded_fraction, (int, float)) or not 0 <= max_unsharded_fraction <= 1:
    raise ShardingError(
        f"max_unsharded_fraction must be a number in [0, 1], e.g. 0.02; got "
        f"{max_unsharded_fraction!r}"
    )
  fraction = unsharded_fraction(plan)
  if fraction <= max_unsharded_fraction:
    return
  worst = "; ".join(_describe(plan, e) for e in least_sharded(plan, NAMED_IN_ERRORS))
  raise ShardingError(
      f"{100 * fraction:.3g}% of the planned bytes are not split over the whole mesh "
      f"{dict(plan.mesh.shape)}, more than max_unsharded_fraction={max_unsharded_fraction:g}. "
      f"Largest unsharded leaves: {worst}. Shard them (a strategy entry, a fixed regex, "
      "divisible dims), change the mesh, or raise the limit."
  )


def _describe(plan: Plan, entry: Entry) -> str:
  return (
      f"{entry.name} {entry.shape} {entry.spec} "
      f"({entry.bytes_per_device / MiB:.3f} MiB/device, {plan.pieces(entry)} of "
      f"{plan.num_devices} pieces)"
  )


# ``pieces(plan, entry)`` is now ``plan.pieces(entry)``; so with the other two.
__getattr__ = _deprecated(
    {name: f"bv_sharding.Plan.{name}" for name in ("pieces", "unsharded_bytes", "claims")},
    __name__,
)
