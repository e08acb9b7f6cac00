"""The placements the benchmarks compare: the project's default plan and the baselines.

* ``default``: ``llm_fsdp`` on the named kernels, then ``fsdp`` on whatever else divides
  (norm scales too: at 256 devices their copies would cost more than 2%); optimizer
  state follows its params.
* ``big_vision_fsdp``: big_vision's ``fsdp`` rule applied to params and state alike,
  each leaf on its own (no following).
* ``seed_rules``: the seed's heuristics on every leaf on its own: substring name
  rules, and list entries (preconditioner lists) on dim -2.
* ``factors_replicated``: the default plan with Kron/Shampoo factors replicated.
* ``kron_factors_on_rows`` (asked for): the default plan with Kron's ``Q`` factors
  taking the param's axis on rows (``preconditioner(dim=0)``) instead of columns.
"""

import dataclasses
from typing import Any

import bv_sharding as bvs
from bv_sharding import ops
from trainers import MiB

DEFAULT = [
    (
        ".*",
        'llm_fsdp(axis="data", min_size_to_shard_mb=0)|fsdp(axis="data", min_size_to_shard_mb=0)',
    )
]
FACTORS = r".*/(Qs_preconditioners|statistics|preconditioners|stats|roots)/.*"
KRON_FACTORS = r".*/Qs_preconditioners/.*"
# The leaf names the seed's heuristics knew (``llm_fsdp``'s), kept as they were for the baseline.
SEED_NEVER_SHARDED = ("scale", "bias")
SEED_LAST_DIM = ("embedding", "out_kernel", "down_kernel")
SEED_SECOND_LAST_DIM = ("q_kernel", "k_kernel", "v_kernel", "gate_kernel", "up_kernel")


def seed_rules(axis, min_size_to_shard_mb=1):
  """The seed's FSDP heuristics, kept as a baseline: the names ``llm_fsdp`` knows, matched as
  substrings of the whole leaf name, and list entries (preconditioner lists) on dim -2.

  Registered only while a baseline is planned (:func:`_independent`).
  """

  def has(name: str, parts) -> bool:
    return any(part in name for part in parts)

  def rule(leaf, spec):
    if leaf.ndim < 2 or leaf.nbytes < min_size_to_shard_mb * MiB:
      return spec, "small"
    if leaf.components[-1].isdigit():
      return ops.place(leaf, spec, -2, axis, requested=False)
    if has(leaf.name, SEED_NEVER_SHARDED):
      return spec, "scale/bias"
    if has(leaf.name, SEED_LAST_DIM):
      return ops.place(leaf, spec, -1, axis, requested=False)
    if has(leaf.name, SEED_SECOND_LAST_DIM):
      return ops.place(leaf, spec, -2, axis, requested=False)
    return ops.place_largest(leaf, spec, axis)

  return rule


@dataclasses.dataclass(frozen=True)
class Placement:
  """Shardings for the params and the optimizer state, and the plan that made them."""

  params: Any
  opt: Any
  plan: bvs.Plan

  def state_bytes_per_device(self, state_root: str) -> int:
    return sum(e.bytes_per_device for e in self.plan.entries if e.name.split("/")[0] == state_root)


def placements(
    params_shape, opt_shape, mesh, second_order: bool, factor_rows: bool = False
) -> dict[str, Placement]:
  """``{name: Placement}`` of one optimizer's params and state, the default and the baselines.

  ``second_order`` adds ``factors_replicated``; with ``factor_rows`` too, ``kron_factors_on_rows``.
  """
  result = {
      "default": _following(params_shape, opt_shape, DEFAULT, mesh),
      "big_vision_fsdp": _independent(params_shape, opt_shape, 'fsdp(axis="data")', mesh),
      "seed_rules": _independent(params_shape, opt_shape, 'seed_rules(axis="data")', mesh),
  }
  if second_order:
    result["factors_replicated"] = _following(
        params_shape, opt_shape, [(FACTORS, "replicate()")] + DEFAULT, mesh
    )
  if second_order and factor_rows:
    result["kron_factors_on_rows"] = _following(
        params_shape, opt_shape, [(KRON_FACTORS, "preconditioner(dim=0)")] + DEFAULT, mesh
    )
  return result


def _following(params_shape, opt_shape, strategy, mesh) -> Placement:
  plan = bvs.plan({"params": params_shape, "opt": opt_shape}, strategy, mesh)
  return Placement(plan.shardings["params"], plan.shardings["opt"], plan)


def _independent(params_shape, opt_shape, chain, mesh) -> Placement:
  """Every leaf planned on its own: without a top-level "params" entry nothing follows."""
  with bvs.temporary_ops(seed_rules=seed_rules):
    plan = bvs.plan({"p": params_shape, "opt": opt_shape}, chain, mesh)
  return Placement(plan.shardings["p"], plan.shardings["opt"], plan)
