"""Kron between its fits: a step that does not fit Q draws no probe.

The probe of a param cut into tiles is drawn where its tiles are fitted (a pool's slots, or a
device's own tiles), inside the fit's ``lax.cond``, so a step that takes the cond's other side
draws nothing. Checked on the update's jaxpr, as an accelerator's step traces it: no draw of
a tile's size outside a ``cond``.
"""

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from bv_sharding.optimizers import ParamLayout, scale_by_kron, skipping

DRAWS = {"threefry2x32", "random_bits"}
TILE = 64


def _draws_outside_cond(jaxpr, big: int) -> list[str]:
  """The draws of at least ``big`` elements in ``jaxpr`` (and the jaxprs it calls), but those
  inside a ``cond``'s branches."""
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "cond":
      continue
    if eqn.primitive.name in DRAWS and any(v.aval.size >= big for v in eqn.outvars):
      found.append(f"{eqn.primitive.name} {[v.aval.shape for v in eqn.outvars]}")
    for param in eqn.params.values():
      for sub in param if isinstance(param, (list, tuple)) else [param]:
        inner = getattr(sub, "jaxpr", sub)
        if isinstance(inner, jax.extend.core.Jaxpr):
          found += _draws_outside_cond(inner, big)
  return found


def test_a_step_draws_its_probes_under_the_fit_cond_alone():
  mesh = jax.make_mesh((4, 2), ("data", "model"), (jax.sharding.AxisType.Auto,) * 2)
  # A pooled param (its tiles span the data shards), a shard-local one, and one whose
  # tiles are dealt to owners.
  params = {
      "pooled": jnp.ones((96, 2 * TILE)),
      "local": jnp.ones((4 * TILE, 2 * TILE)),
      "owned": jnp.ones((2 * TILE, 4 * TILE)),
  }
  specs = {"pooled": P("data", None), "local": P("data", "model"), "owned": P("data", None)}
  layout = ParamLayout(specs, mesh)
  tx = scale_by_kron(preconditioner_update_probability=0.5, block_size=TILE, layout=layout)
  state = tx.init(params)
  with skipping(True):  # As an accelerator's step: the work a step may skip under lax.cond.
    jaxpr = jax.make_jaxpr(tx.update)(params, state).jaxpr
  assert _draws_outside_cond(jaxpr, TILE * TILE) == []
  # The check sees draws: without a layout the tiles run on global arrays, their probes drawn
  # whole on every step.
  whole = scale_by_kron(preconditioner_update_probability=0.5, block_size=TILE)
  with skipping(True):
    jaxpr = jax.make_jaxpr(whole.update)(params, whole.init(params)).jaxpr
  assert _draws_outside_cond(jaxpr, TILE * TILE)
