"""An optimizer state born mid-run: its schedule at the global step, a ramp, carried moments.

When a resumed run re-initialises its optimizer state (another ``config.optax_name``, or
Kron/Shampoo blocks that are not the same tiles on the new mesh), the new state is born
from the plan at step ``s`` with three differences from a fresh one:

* **The schedule continues.** Every learning-rate schedule the trainer builds is applied
  by an ``optax.ScaleByScheduleState``; :func:`at_step` sets each one's count to ``s``, so
  the update of step ``s + 1`` applies ``lr(s)``, as the run that never changed would: the
  run still ends at ``linear_end`` at ``total_steps``.
* **A ramp** (``config.rewarmup_steps`` = R > 0, :func:`ramp_in` chained last) scales the
  new optimizer's updates by ``min(1, n / R)``, ``n`` the steps since its birth (0 at the
  first one, as big_vision's warmup). A fresh run's ramp is born saturated (count R).
* **First moments are carried** (:func:`carried_leaves`) between optimizers whose ``mu`` is
  an EMA of the grads bias-corrected by the ``count`` beside it (``FIRST_MOMENT``): Adam's
  ``mu`` becomes Kron's ``mu`` and Adam's ``count`` Kron's ``count``, so Kron's bias
  correction ``mu / (1 - b1^count)`` sees the moment as Adam left it. Kron also anneals its
  preconditioner update probability by that count: the fresh preconditioner is fitted at
  ``prob(count)``, the annealed probability, not at the flat start's 1.0.

Example:
  >>> import jax.numpy as jnp, optax
  >>> tx = optax.chain(optax.scale_by_schedule(lambda n: 0.1 * n), ramp_in(4))
  >>> state = at_step(tx.init({"w": jnp.ones(2)}), 20)
  >>> int(state[0].count), int(state[1].count)  # the schedule at step 20, the ramp at 0
  (20, 0)
  >>> [ramp(4, n) for n in (0, 2, 4, 9)]
  [0.0, 0.5, 1.0, 1.0]
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

# Optimizers whose "mu" is an EMA of the grads (b1) bias-corrected by the "count" beside it.
FIRST_MOMENT = ("adamw", "lamb", "kron")
_MU = "/mu/"


class RampState(NamedTuple):
  """The steps the ramp has applied (saturated at birth for a fresh run)."""

  count: jax.Array


def ramp(steps: int, n) -> float:
  """The ramp's multiplier after ``n`` steps of the new optimizer: ``min(1, n / steps)``."""
  return min(1.0, n / steps) if steps else 1.0


def ramp_in(steps: int) -> optax.GradientTransformation:
  """Scales updates by :func:`ramp` of its count; born at ``steps`` (no ramp) for a fresh run."""

  def init(params):
    del params
    return RampState(jnp.asarray(steps, jnp.int32))

  def update(updates, state, params=None):
    del params
    scale = jnp.minimum(1.0, state.count / steps)
    updates = jax.tree.map(lambda u: (u * scale).astype(u.dtype), updates)
    return updates, RampState(optax.safe_increment(state.count))

  return optax.GradientTransformation(init, update)


def at_step(state, step: int):
  """``state`` with every schedule count at ``step`` and every ramp count at 0 (same shardings)."""

  def reborn(x):
    if isinstance(x, optax.ScaleByScheduleState):
      return x._replace(count=_filled(x.count, step))
    if isinstance(x, RampState):
      return x._replace(count=_filled(x.count, 0))
    return x

  is_count = lambda x: isinstance(x, (optax.ScaleByScheduleState, RampState))
  return jax.tree.map(reborn, state, is_leaf=is_count)


def _filled(x: jax.Array, value: int) -> jax.Array:
  return jax.device_put(jnp.full(x.shape, value, x.dtype), x.sharding)


def leaf_names(tree) -> list[str]:
  """Each leaf's path, its keys joined by "/" (as checkpoints name them), in flatten order."""
  flat, _ = jax.tree_util.tree_flatten_with_path(tree)
  return [jax.tree_util.keystr(path, simple=True, separator="/") for path, _ in flat]


def first_moments(table: dict) -> tuple[str, dict[str, str]] | None:
  """``(count leaf, {param path: mu leaf})`` of a ``{name: (shape, dtype)}`` state table with
  exactly one ``.../mu/...`` group and a ``count`` beside it; None otherwise.

  Example:
    >>> first_moments({"0/count": ((), "int32"), "0/mu/w": ((2,), "float32")})
    ('0/count', {'w': '0/mu/w'})
  """
  groups: dict[str, dict[str, str]] = {}
  for name in table:
    prefix, found, param = name.partition(_MU)
    if found:
      groups.setdefault(prefix, {})[param] = name
  if len(groups) != 1:
    return None
  ((prefix, moments),) = groups.items()
  count = f"{prefix}/count"
  return (count, moments) if count in table else None


def carried_leaves(saved: tuple[str, dict], new: tuple[str, dict]) -> dict[str, str]:
  """``{new leaf: saved leaf}`` to carry: every first moment and its count, or nothing.

  ``saved``, ``new``: ``(optax_name, {leaf name: (shape, dtype)})``. Both optimizers must be
  in ``FIRST_MOMENT`` and every new moment must have a saved one of its param and shape.

  Example:
    >>> adam = {"0/0/count": ((), "int32"), "0/0/mu/w": ((2,), "f32"), "0/0/nu/w": ((2,), "f32")}
    >>> kron = {"0/0/count": ((), "int32"), "0/0/mu/w": ((2,), "f32"), "0/0/Qs/w/0": ((2,), "f32")}
    >>> carried_leaves(("adamw", adam), ("kron", kron))
    {'0/0/mu/w': '0/0/mu/w', '0/0/count': '0/0/count'}
  """
  (saved_name, saved_table), (new_name, new_table) = saved, new
  if saved_name not in FIRST_MOMENT or new_name not in FIRST_MOMENT:
    return {}
  have, want = first_moments(saved_table), first_moments(new_table)
  if have is None or want is None:
    return {}
  fits = lambda param: param in have[1] and (
      saved_table[have[1][param]][0] == new_table[want[1][param]][0]
  )
  if not all(fits(param) for param in want[1]):
    return {}
  return {**{leaf: have[1][param] for param, leaf in want[1].items()}, want[0]: have[0]}


def carry(state, carried: dict[str, str], read: Callable[[dict], dict]) -> Any:
  """``state`` with the leaves ``carried`` names (new -> saved) replaced by the saved ones.

  ``read({saved name: new leaf})``: ``{saved name: array}`` in each new leaf's sharding.
  """
  names = leaf_names(state)
  leaves, treedef = jax.tree.flatten(state)
  new = dict(zip(names, leaves))
  values = read({saved: new[leaf] for leaf, saved in carried.items()}) if carried else {}
  return treedef.unflatten(
      [values[carried[n]] if n in carried else x for n, x in zip(names, leaves)]
  )


def reborn(state, step: int, saved: tuple[str, dict], name: str, read) -> tuple[Any, dict]:
  """``(state, carried)``: a state just born at ``step`` for optimizer ``name``, its schedule
  and ramp reborn there (:func:`at_step`) and the saved first moments in it (:func:`carry`).

  ``saved``: the saving run's ``(optax_name, {leaf: (shape, dtype)})``; ``read``: as for
  :func:`carry`; ``carried``: ``{new leaf: saved leaf}``.
  """
  table = {
      n: (tuple(x.shape), str(x.dtype)) for n, x in zip(leaf_names(state), jax.tree.leaves(state))
  }
  carried = carried_leaves(saved, (name, table))
  return carry(at_step(state, step), carried, read), carried
