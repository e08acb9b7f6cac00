"""How much of a plan is covered: by the mesh (bytes split over every device) and by the strategy.

Mesh coverage is :attr:`bv_sharding.Plan.coverage`: each leaf's bytes weighted by
``pieces / devices``, so a leaf counts as fully sharded only when its spec splits
it over every mesh axis. The *unsharded fraction* is ``1 - coverage``, and a
leaf's *unsharded bytes* are ``nbytes * (1 - pieces / devices)``: what the mesh
could still take off each device. :func:`check_coverage` is the gate (MaxText's
"five largest unsharded tensors" check) a trainer calls before allocating.

Strategy coverage: :func:`claims` lists the strategy entries whose regex claimed
no leaf (almost always a typo) and the leaves no entry claimed.

Example:
  >>> import jax
  >>> import bv_sharding as bvs
  >>> tree = {"w": jax.ShapeDtypeStruct((1024, 1024), "float32"),
  ...         "b": jax.ShapeDtypeStruct((1024,), "float32")}
  >>> strategy = [("w", 'fsdp(axis="data", min_size_to_shard_mb=0)'), ("bais", "replicate()")]
  >>> plan = bvs.plan(tree, strategy, bvs.make_abstract_mesh([("data", 8)], 8))
  >>> round(unsharded_fraction(plan), 4)
  0.0009
  >>> claims(plan)
  ([('bais', 'replicate()')], ['b'])
  >>> check_coverage(plan, 0.01)
  >>> check_coverage(plan, 0.0001)
  Traceback (most recent call last):
  ...
  bv_sharding.errors.ShardingError: 0.0854% of the planned bytes are not split over the whole mesh ...
"""

from bv_sharding import specs
from bv_sharding.errors import ShardingError
from bv_sharding.planning import Entry, Plan
from bv_sharding.specs import MiB

NAMED_IN_ERRORS = 5


def pieces(plan: Plan, entry: Entry) -> int:
  """How many pieces ``entry``'s spec cuts its leaf into on ``plan``'s mesh."""
  return specs.shards(tuple(entry.spec), dict(plan.mesh.shape))


def unsharded_bytes(plan: Plan, entry: Entry) -> float:
  """``entry``'s bytes times the share of the mesh its spec does not split it over."""
  return entry.nbytes * (1 - pieces(plan, entry) / plan.num_devices)


def unsharded_fraction(plan: Plan) -> float:
  """``1 - plan.coverage``: the bytes-weighted share of the ideal split not achieved."""
  return 1 - plan.coverage


def least_sharded(plan: Plan, count: int | None = None) -> list[Entry]:
  """Entries not split over the whole mesh, most unsharded bytes first (``count`` of them)."""
  short = [e for e in plan.entries if unsharded_bytes(plan, e) > 0]
  short.sort(key=lambda e: (-unsharded_bytes(plan, e), e.name))
  return short[:count]


def check_coverage(plan: Plan, max_unsharded_fraction: float) -> None:
  """Raises ``ShardingError`` naming the five least sharded leaves when more than
  ``max_unsharded_fraction`` of the plan's bytes is unsharded (``config.max_unsharded_fraction``).
  """
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


def claims(plan: Plan) -> tuple[list[tuple[str, str]], list[str]]:
  """``(entries of plan.strategy that claimed no leaf, leaves no entry claimed)``.

  An entry claims the leaves whose names its regex fullmatches first (``Entry.claimed_by``,
  recorded while planning); a state leaf no entry claims still follows its param (see
  :mod:`bv_sharding.following`).
  """
  claimed = {e.claimed_by for e in plan.entries}
  unused = [pair for i, pair in enumerate(plan.strategy) if i not in claimed]
  return unused, [e.name for e in plan.entries if e.claimed_by is None]


def _describe(plan: Plan, entry: Entry) -> str:
  return (
      f"{entry.name} {entry.shape} {entry.spec} "
      f"({entry.bytes_per_device / MiB:.3f} MiB/device, {pieces(plan, entry)} of "
      f"{plan.num_devices} pieces)"
  )
