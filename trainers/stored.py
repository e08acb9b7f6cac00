"""The form a run's state is checkpointed in: the same on any mesh.

An optimizer may keep some of its state where it runs it, in shapes that depend on the mesh
(SOAP's pools, ``config.optax.resident_padding``: ``bv_sharding/optimizers/holding.py``). A
checkpoint holds it given back to the params instead
(``bv_sharding.optimizers.canonical_state``), so that a run on another mesh, or with another
optimizer, reads it as any other state; the run holds it again on restore
(``bv_sharding.optimizers.held_state``). Where the state holds no such pool the two forms are
one and nothing is converted.

Example: ``form = stored_form(plan, layout, strategy, rules, params_plan)``;
``form.to_stored(state)`` before a save, ``form.from_stored(restored)`` after a restore.
"""

import dataclasses
from collections.abc import Callable

import jax
from jax.sharding import AxisType

import bv_sharding as bvs
from bv_sharding import optimizers


@dataclasses.dataclass(frozen=True)
class StoredForm:
  """``plan``: the plan of ``{"params", "opt"}`` as checkpointed; ``to_stored(state)`` and
  ``from_stored(stored)``: the state in that form (in ``plan``'s shardings) and back (in the
  run's), each one jitted program, the identity where the forms are one."""

  plan: bvs.Plan
  to_stored: Callable
  from_stored: Callable

  @property
  def converts(self) -> bool:
    """Whether the checkpointed form differs from the run's."""
    return self.to_stored is not _same


def _same(state):
  return state


def stored_form(plan: bvs.Plan, layout, strategy, rules, params_plan: bvs.Plan) -> StoredForm:
  """The :class:`StoredForm` of a run whose state ``plan`` places, its optimizer built on
  ``layout``; ``strategy``, ``rules`` and ``params_plan`` plan the stored form as the run's."""
  abstract = plan.abstract()
  params, opt = abstract["params"], abstract["opt"]
  given_back = lambda o: optimizers.canonical_state(o, params, layout)
  canonical = jax.eval_shape(given_back, opt)
  if jax.tree.structure(canonical) == jax.tree.structure(opt):
    return StoredForm(plan, _same, _same)
  stored = bvs.plan(
      {"params": params, "opt": canonical}, strategy, plan.mesh, rules=rules, params=params_plan
  )
  to_stored = lambda state: {"params": state["params"], "opt": given_back(state["opt"])}
  from_stored = lambda state: {
      "params": state["params"],
      "opt": optimizers.held_state(state["opt"], opt, params, layout),
  }
  return StoredForm(stored, _jitted(to_stored, stored), _jitted(from_stored, plan))


def _jitted(convert: Callable, target: bvs.Plan) -> Callable:
  """``convert`` jitted into ``target``'s shardings; on a mesh with Explicit axes run with them
  switched to Auto (``jax.sharding.auto_axes``), as the optimizers' updates are, where its
  slices and reshapes of sharded arrays are XLA's to place."""
  if AxisType.Explicit not in target.mesh.axis_types:
    return jax.jit(convert, out_shardings=target.shardings)
  auto = jax.sharding.auto_axes(convert, out_sharding=target.shardings)
  return jax.jit(auto, out_shardings=target.shardings)
