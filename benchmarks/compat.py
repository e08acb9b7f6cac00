"""Aliases that let the published psgd-jax 0.2.9 and precondition-opt 0.3.0 import today.

psgd-jax imports ``optax._src.clipping`` (moved in optax 0.2.7) and
precondition-opt calls ``jax.tree_map`` and friends (removed in JAX 0.6). Only the
optimizer zoo (``benchmarks/zoo.py``) and ``tools/make_reference_data.py`` need them;
the library and the trainer never import either package.

Example:
  >>> import jax
  >>> add_removed_names()
  >>> jax.tree_map is jax.tree.map
  True
"""

import sys

import jax
import optax

REMOVED_JAX_NAMES = {
    "tree_map": jax.tree.map,
    "tree_flatten": jax.tree_util.tree_flatten,
    "tree_unflatten": jax.tree_util.tree_unflatten,
}


def add_removed_names() -> None:
  """Puts back the names the two packages import, where this JAX/optax lacks them."""
  clipping = getattr(getattr(optax, "transforms", None), "_clipping", None)
  if clipping is not None:
    sys.modules.setdefault("optax._src.clipping", clipping)
  for name, new in REMOVED_JAX_NAMES.items():
    if not hasattr(jax, name):
      setattr(jax, name, new)
