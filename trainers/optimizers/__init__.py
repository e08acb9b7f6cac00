"""The trainer's optimizers by name; big_vision's optimizer section over the library's.

The registry names optax's optimizers and the library's PSGD Kron, Shampoo, SOAP and Muon
(:mod:`bv_sharding.optimizers`).

Example:
  >>> from trainers.optimizers import make_optimizer
  >>> tx = make_optimizer("shampoo", 1e-3, block_size=256, clip_norm=1.0)
"""

from bv_sharding.big_vision.schedules import make_schedule
from bv_sharding.optimizers import (
    BuiltOptimizer,
    OptimizerError,
    ParamLayout,
    ShampooParamState,
    ShampooState,
    Stacks,
    kron,
    migrate_state,
    muon,
    precond_update_prob_schedule,
    same_blocking,
    scale_by_kron,
    scale_by_muon,
    scale_by_shampoo,
    scale_by_soap,
    shampoo,
    soap,
)
from trainers.optimizers.from_config import from_config
from trainers.optimizers.registry import (
    OPTIMIZERS,
    decay_mask,
    make_optimizer,
    state_decays,
)

__all__ = [
    "OPTIMIZERS",
    "BuiltOptimizer",
    "OptimizerError",
    "ParamLayout",
    "ShampooParamState",
    "ShampooState",
    "Stacks",
    "decay_mask",
    "from_config",
    "kron",
    "make_optimizer",
    "make_schedule",
    "migrate_state",
    "muon",
    "precond_update_prob_schedule",
    "same_blocking",
    "scale_by_kron",
    "scale_by_muon",
    "scale_by_shampoo",
    "scale_by_soap",
    "shampoo",
    "soap",
    "state_decays",
]
