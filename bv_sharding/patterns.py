"""``config.sharding_strategy`` and ``config.sharding_rules``, parsed and checked against a mesh.

A strategy is a list of ``(regex, op_chain)`` pairs; a leaf is claimed by the
first regex that ``fullmatch``es its name. A bare string ``s`` means ``[(".*", s)]``.
Regexes are ``re`` syntax, matched by the ``regex`` package with a time bound
(``MATCH_TIMEOUT_S`` per leaf), so a catastrophically backtracking one such as
``(a|aa)+$`` fails with a ``ShardingError`` naming it instead of hanging the plan.

Example:
  >>> pats = parse_strategy([(".*embedding", 'shard_dim(axis="model", dim=-1)'),
  ...                        (".*", 'fsdp(axis="data")')], {"data": 4, "model": 2})
  >>> match(pats, "params/embed/embedding").chain_text
  'shard_dim(axis="model", dim=-1)'
"""

import dataclasses
from collections.abc import Mapping, Sequence

import regex as re  # re's syntax, plus a time bound on each match.

from bv_sharding import registry, specs
from bv_sharding.errors import ShardingError

MATCH_TIMEOUT_S = 1.0


@dataclasses.dataclass(frozen=True)
class Pattern:
  """One strategy entry: the regex as written, compiled, and its bound op chain."""

  regex: str
  compiled: re.Pattern
  chain_text: str
  ops: tuple[registry.Op, ...]


def parse_strategy(strategy, mesh_axes: dict[str, int]) -> tuple[Pattern, ...]:
  """Parses and checks a strategy; every mesh axis an op names must exist in ``mesh_axes``."""
  if isinstance(strategy, str):
    strategy = [(".*", strategy)]
  if isinstance(strategy, Mapping):
    raise ShardingError(
        f"sharding_strategy is a {type(strategy).__name__}; write it as a list of (regex, "
        "op_chain) pairs, e.g. list(strategy.items()): the first regex that matches claims a leaf"
    )
  try:
    if not isinstance(strategy, Sequence) or any(_not_pair(p) for p in strategy):
      raise TypeError
    pairs = [(regex, chain) for regex, chain in strategy]
  except (TypeError, ValueError):
    raise ShardingError(
        f"sharding_strategy must be a list of (regex, op_chain) pairs or one op "
        f'chain string, e.g. [(".*", \'fsdp(axis="data")\')]; got {strategy!r}'
    ) from None
  if not pairs:
    raise ShardingError(
        "sharding_strategy is empty, which would leave every leaf replicated without a word; "
        'give [(".*", "replicate()")] to replicate on purpose, or an op such as '
        "'fsdp(axis=\"data\")'"
    )
  return tuple(_pattern(regex, chain, mesh_axes) for regex, chain in pairs)


def match(patterns: Sequence[Pattern], name: str) -> Pattern | None:
  """The first pattern whose regex fullmatches ``name``."""
  return next((p for p in patterns if fullmatch(p, name)), None)


def fullmatch(pattern: Pattern, name: str) -> bool:
  """Whether ``pattern`` fullmatches ``name``; raises if that takes over ``MATCH_TIMEOUT_S``."""
  return bounded_fullmatch(pattern.compiled, name, "strategy")


def compiled_regex(regex: str, where: str, error: type[Exception] = ShardingError) -> re.Pattern:
  """``regex`` compiled (``re`` syntax), or ``error`` naming it and ``where`` it is written.

  Example:
    >>> compiled_regex("(", "config.schedule")
    Traceback (most recent call last):
    ...
    bv_sharding.errors.ShardingError: config.schedule regex '(' does not compile: missing ) ...
  """
  try:
    return re.compile(regex)
  except re.error as e:
    raise error(
        f"{where} regex {regex!r} does not compile: {e}. "
        "Escape special characters, e.g. '.*\\\\.bias'."
    ) from None


def bounded_fullmatch(
    compiled: re.Pattern, name: str, where: str, error: type[Exception] = ShardingError
) -> bool:
  """Whether ``compiled`` fullmatches ``name``; ``error`` if that takes over ``MATCH_TIMEOUT_S``.

  Example: ``bounded_fullmatch(compiled_regex(".*/kernel", "config.wd_mults"), "a/kernel", "")``.
  """
  try:
    return compiled.fullmatch(name, timeout=MATCH_TIMEOUT_S) is not None
  except TimeoutError:
    raise error(
        f"{where} regex {compiled.pattern!r} took over {MATCH_TIMEOUT_S:g} s to match leaf "
        f"{name!r}: it backtracks catastrophically (nested or overlapping repeats such as "
        "'(a|aa)+'); simplify it, e.g. '.*kernel' instead of '(.*kernel)+'"
    ) from None


def unmatched(patterns: Sequence[Pattern], names: Sequence[str]) -> list[str]:
  """Regexes of ``patterns`` that fullmatch none of ``names``, in strategy order."""
  return [p.regex for p in patterns if not any(fullmatch(p, n) for n in names)]


def parse_rules(rules, mesh_axes: dict[str, int], source: str = "sharding_rules") -> tuple:
  """Checks ``config.sharding_rules``: ``(logical_name, target)`` pairs, as flax reads them.

  A target is ``None``, a mesh axis, or a tuple or list of mesh axes; an empty
  one (MaxText's ``['kv', []]``) means ``None``, as it does to flax. Lists
  become tuples; a logical name listed again is a fallback (flax's order).
  ``source`` names where the rules came from in error messages.

  Example:
    >>> parse_rules([["batch", ["data", "fsdp"]], ["kv", []]], {"data": 4, "fsdp": 2})
    (('batch', ('data', 'fsdp')), ('kv', None))
  """
  if rules is None:
    return ()
  try:
    pairs = tuple((name, target) for name, target in rules)
  except (TypeError, ValueError):
    raise ShardingError(
        f"{source} must be a list of (logical_name, mesh_axis) pairs, "
        f'e.g. [("act_batch", "data")]; got {rules!r}'
    ) from None
  return tuple((name, _rule_target(name, target, mesh_axes, source)) for name, target in pairs)


def _rule_target(name, target, mesh_axes: dict[str, int], source: str):
  where = f"{source} entry {(name, target)!r}"
  if not isinstance(name, str):
    raise ShardingError(f"{where}: the logical name must be a string")
  if target is None or (isinstance(target, (tuple, list)) and not target):
    return None
  axis = specs.check_axis(where, target)
  check_mesh_axes(axis, mesh_axes, where)
  return axis


def check_mesh_axes(axis, mesh_axes: dict[str, int], where: str) -> None:
  for a in specs.axes_of(axis):
    if a not in mesh_axes:
      raise ShardingError(
          f"{where}: the mesh has no axis {a!r}; its axes are {list(mesh_axes)}. "
          "Use one of those or add the axis to config.mesh."
      )


def _not_pair(entry) -> bool:
  return isinstance(entry, (str, bytes)) or not isinstance(entry, Sequence) or len(entry) != 2


def _pattern(regex, chain, mesh_axes) -> Pattern:
  if not isinstance(regex, str):
    raise ShardingError(f"strategy regex must be a string, got {regex!r} (paired with {chain!r})")
  compiled = compiled_regex(regex, "strategy")
  ops = registry.parse_chain(chain)
  for op in ops:
    where = f"{op.text!r} in strategy entry {regex!r}"
    if "axis" in op.arguments:
      check_mesh_axes(op.arguments["axis"], mesh_axes, where)
    if not isinstance(op.storage_only, bool):
      check_mesh_axes(op.storage_only, mesh_axes, where)
  return Pattern(regex, compiled, chain, ops)
