"""Kron, Shampoo, SOAP and Muon on the params' layout, with state dtypes and migration.

Each is an optax ``GradientTransformation`` in two forms: ``scale_by_*`` (no learning rate,
for a chain such as big_vision's) and the full optimizer (``kron``, ``shampoo``, ``soap``, ``muon``).
Given a :class:`ParamLayout` (the plan's param specs and the mesh) they compute each block
where its shard lives. Their state is the same on any mesh (each block stack in the order of
its blocks' places in the param), and ``bvs.plan`` places it where they run it
(:class:`Stacks`, :mod:`bv_sharding.optimizers.placement`). Kron and SOAP can keep their
pools' state where they run instead (``resident_padding``, :class:`Resident`): fewer bytes
and a smaller program each step, a state whose shapes depend on the mesh, given in the form
that does not by :func:`canonical_state` (and back by :func:`held_state`).

Example:
  >>> import jax, jax.numpy as jnp
  >>> from bv_sharding.optimizers import scale_by_shampoo
  >>> tx = scale_by_shampoo(block_size=4, graft_type="sgd", beta1=0.0)
  >>> params = {"w": jnp.ones((8, 4))}
  >>> updates, _ = tx.update(params, tx.init(params), params)
  >>> updates["w"].shape
  (8, 4)
"""

from bv_sharding.errors import OptimizerError
from bv_sharding.optimizers import factored as _factored  # noqa: F401  (places optax's FactoredState)
from bv_sharding.optimizers.axes import auto_axes_update
from bv_sharding.optimizers.gating import skipping
from bv_sharding.optimizers.kron import kron, precond_update_prob_schedule, scale_by_kron
from bv_sharding.optimizers.layout import ParamLayout, layer_stacks
from bv_sharding.optimizers.migration import BuiltOptimizer, migrate_state
from bv_sharding.optimizers.muon import matrix_dims, muon, scale_by_muon
from bv_sharding.optimizers.placement import Stacks, Tiling
from bv_sharding.optimizers.pools import Resident
from bv_sharding.optimizers.portable import canonical_state, held_state
from bv_sharding.optimizers.rebirth import (
    RampState,
    ramp,
    ramp_in,
    ramped,
    refill,
    unramped,
    with_ramp,
)
from bv_sharding.optimizers.shampoo import (
    ShampooParamState,
    ShampooState,
    scale_by_shampoo,
    shampoo,
)
from bv_sharding.optimizers.soap import LR_SCALE as SOAP_LR_SCALE
from bv_sharding.optimizers.soap import SoapParamState, SoapState, scale_by_soap, soap
from bv_sharding.optimizers.state_dtype import compute_dtype, with_state_dtype
from bv_sharding.optimizers.tiles import same_blocking

__all__ = [
    "BuiltOptimizer",
    "OptimizerError",
    "ParamLayout",
    "RampState",
    "Resident",
    "SOAP_LR_SCALE",
    "ShampooParamState",
    "ShampooState",
    "SoapParamState",
    "SoapState",
    "auto_axes_update",
    "canonical_state",
    "compute_dtype",
    "held_state",
    "skipping",
    "kron",
    "layer_stacks",
    "migrate_state",
    "matrix_dims",
    "muon",
    "precond_update_prob_schedule",
    "ramp",
    "ramp_in",
    "ramped",
    "refill",
    "unramped",
    "with_ramp",
    "same_blocking",
    "scale_by_kron",
    "scale_by_muon",
    "scale_by_shampoo",
    "scale_by_soap",
    "shampoo",
    "soap",
    "Stacks",
    "Tiling",
    "with_state_dtype",
]
