"""An optimizer state born mid-run: its schedule at the global step, a ramp, carried moments.

When a resumed run re-initialises its optimizer state (another ``config.optax_name``, or
Kron/Shampoo blocks that are not the same tiles on the new mesh), the new state is born
from the plan at step ``s`` with these differences from a fresh one:

* **The schedule continues.** Every learning-rate schedule a config builds is applied
  by an ``optax.ScaleByScheduleState``; :func:`at_step` sets each one's count to ``s``, so
  the update of step ``s + 1`` applies ``lr(s)``, as the run that never changed would: the
  run still ends at ``linear_end`` at ``total_steps``. schedule_free's step count continues
  there too, its average born holding the params with one step's weight.
* **A ramp** (``config.rewarmup_steps`` = R, :func:`ramped`: :func:`ramp_in` chained last)
  scales the new optimizer's updates by ``min(1, n / R)``, ``n`` the steps since its birth (0
  at the first one, as big_vision's warmup). A fresh run's ramp is born saturated
  (:data:`FULL`): its updates are the chain's own times exactly 1, the same math (in a jitted
  step XLA fuses that product with its neighbours, so a value's last bit may differ).
* **Moments are carried with the count that corrects them** (:func:`carried_leaves`), per
  group of ``mu`` (and ``nu``) leaves beside a ``count``, decided from the two state tables:
  a new group takes its moments and its count from one saved group holding every moment it
  has, or is born afresh. Adam's ``count`` bias-corrects ``mu`` and ``nu``, so Kron's ``mu``
  alone never fills it (Kron -> Adam: Adam born afresh, not a zero ``nu`` corrected as at
  step ``s``); Kron's corrects ``mu`` only (Adam -> Kron: ``mu`` and ``count`` carried, and
  Kron anneals its preconditioner update probability by that count). Factors and
  statistics are born afresh.
* **A heavy-ball sum is born full** (:func:`heavy_ball_sources`, :func:`born_sum`): SGD's
  ``trace`` and Shampoo's ``momentum`` (``m = beta m + d``, with the new optimizer's
  ``beta``) start as a run summing all along holds them, ``E[d] / (1 - beta)``, not at zero
  (a tenth of the run's own, at ``beta`` 0.9): from a saved sum of the same field
  (``(1 - beta') m``), else SGD's from any saved ``mu`` of each param (its bias-corrected
  mean), Shampoo's (a sum of Adam-grafted steps) from Adam's direction in a saved ``mu``,
  ``nu``, ``count`` group, else from a first moment alone (a ``mu``, or SGD's trace) in the
  gradients' units, marked so for Shampoo to divide by its first gradient's RMS
  (:func:`in_grad_units`). Each saved moment is read with the decays the saving run recorded
  in its checkpoint (``registry.state_decays``, :meth:`BuiltOptimizer.record`: Lion's ``mu``
  decays by its ``b2``), the new optimizer's standing in for a checkpoint that recorded none.
* **A first moment no saved leaf gives is born at zero and refilled** (:func:`refill`,
  chained by the registry's sgd, shampoo and soap): Adafactor keeps no first moment, SOAP's
  lie in its own bases and Shampoo's momentum sums directions, not grads, so the new sum's
  ``E[d]`` is not known; SGD's trace and Shampoo's momentum then start at zero and each
  param's updates are scaled by :func:`refill_scale` of the weight the sum misses, so the
  first ones are at a full sum's scale (a fresh run's at that step, not at step 0). SOAP's
  ``mu`` (never carried) is an EMA that Adam's bias correction fills as if its terms were
  alike; its correction is the refill's instead (``corrected``). The log lists each such
  leaf among those born afresh, marked :data:`REFILLED`.
* **SOAP moves from its first step** (:func:`moving`): a fresh SOAP's first step only fits
  its statistics and bases (count 0, as the authors' reference); born mid-run its count is 1,
  and its first step fits them and takes Adam's step (``soap.py``), marked :data:`MOVING`.

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

from bv_sharding.errors import OptimizerError
from bv_sharding.optimizers import opaque
from bv_sharding.optimizers.shampoo import GRAD_UNITS
from bv_sharding.optimizers.soap import SoapState

# The moments a count beside them bias-corrects: EMAs of the grads and of their squares.
_MOMENTS = ("mu", "nu")
# Heavy-ball sums ``m = beta m + d`` by the field their leaves lie under, and the field of the
# second moment that scales what they sum: SGD's trace sums grads (None), Shampoo's momentum
# its Adam-grafted directions (their ``graft_nu``).
_HEAVY_BALLS = {"trace": None, "momentum": "graft_nu"}
_GRADS = "trace"  # The sum of grads: ``(1 - beta) trace`` is their mean, a first moment.
# Leaves whose presence beside a "count" and a "mu" shows that the count bias-corrects the mu.
_CORRECTED = ("nu", "Qs_preconditioners")


# A count that stays where it is: a fresh run's ramp and refilled moments, which are full.
FULL = jnp.iinfo(jnp.int32).max


class RampState(NamedTuple):
  """The steps the ramp has applied since its state's birth; :data:`FULL` in a fresh run."""

  count: jax.Array


def ramp(steps: int, n) -> float:
  """The ramp's multiplier after ``n`` steps of the new optimizer: ``min(1, n / steps)``."""
  return min(1.0, n / steps) if steps else 1.0


def ramp_in(steps: int) -> optax.GradientTransformation:
  """Scales updates by :func:`ramp` of its count, born :data:`FULL` (a fresh run: the updates
  times exactly 1) and set to 0 by :func:`at_step` (a state born mid-run). ``steps`` 0: never
  scales (nothing multiplied)."""

  def init(params):
    del params
    return RampState(jnp.asarray(FULL, jnp.int32))

  def update(updates, state, params=None):
    del params
    if steps:
      scale = jnp.minimum(1.0, state.count / steps)
      updates = jax.tree.map(lambda u: (u * scale).astype(u.dtype), updates)
    return updates, RampState(optax.safe_increment(state.count))

  return optax.GradientTransformation(init, update)


def ramped(tx: optax.GradientTransformation, steps: int) -> optax.GradientTransformation:
  """The chain ``tx`` with :func:`ramp_in` as its last link: its state ``tx``'s tuple with the
  :class:`RampState` appended, so that every leaf of ``tx``'s state keeps its name (``1/0/mu``
  stays ``1/0/mu``) and a state saved without the ramp is found in it (:func:`unramped`).

  Example:
    >>> tx = ramped(optax.chain(optax.scale_by_adam(), optax.scale(-0.1)), 4)
    >>> state = tx.init({"w": jnp.ones(2)})
    >>> leaf_names(state)
    ['0/count', '0/mu/w', '0/nu/w', '2/count']
    >>> updates, _ = tx.update({"w": jnp.ones(2)}, at_step(state, 20))  # A ramp at 0.
    >>> updates["w"].tolist()
    [-0.0, -0.0]
  """
  ramp_tx = ramp_in(steps)

  def init(params):
    state = tx.init(params)
    if type(state) is not tuple:
      raise OptimizerError(
          f"ramped takes an optax chain, whose state is a tuple; this one's is a "
          f"{type(state).__name__}: pass optax.chain(tx)"
      )
    return (*state, ramp_tx.init(params))

  def update(updates, state, params=None):
    updates, inner = tx.update(updates, unramped(state), params)
    updates, ramp_state = ramp_tx.update(updates, state[-1])
    return updates, (*inner, ramp_state)

  return optax.GradientTransformation(init, update)


def unramped(state):
  """The state of :func:`ramped`'s chain without its ramp (None: ``state`` has no ramp).

  Example:
    >>> unramped(("adam's", RampState(FULL))), unramped(("adam's",))
    (("adam's",), None)
  """
  if type(state) is tuple and state and isinstance(state[-1], RampState):
    return state[:-1]
  return None


def with_ramp(state, like):
  """``state`` saved by a run without the ramp, with ``like``'s (a :func:`ramped` state, or its
  abstract form, in the shardings to hold it) appended, saturated (:data:`FULL`): the updates
  as that run's.

  Example:
    >>> with_ramp(("adam's",), ("adam's", RampState(jnp.int32(0))))[1].count == FULL
    Array(True, dtype=bool)
  """
  return (*state, RampState(_filled(like[-1].count, FULL)))


def at_step(state, step: int, learning_rate: Callable | None = None):
  """``state`` with every schedule count at ``step`` and every ramp count at 0 (same shardings).

  schedule_free's own step count continues at ``step`` too, and with ``learning_rate`` (the
  schedule its averaging weights follow, ``step -> lr``) its average is born holding the
  params with one step's weight (``lr(step + 1) ** 2``, the registry's ``weight_lr_power``
  2), where a fresh run gives its initial params none: the first update then moves the
  params by half the base optimizer's step, as a run averaging all along does (within 2x).
  """

  def reborn(x):
    if isinstance(x, optax.ScaleByScheduleState):
      return x._replace(count=_filled(x.count, step))
    if isinstance(x, RampState):
      return x._replace(count=_filled(x.count, 0))
    if isinstance(x, optax.contrib.ScheduleFreeState):
      x = x._replace(
          step_count=_filled(x.step_count, step + 1),
          base_optimizer_state=at_step(x.base_optimizer_state, step, learning_rate),
      )
      if learning_rate is None:
        return x
      return x._replace(weight_sum=_filled(x.weight_sum, float(learning_rate(step + 1)) ** 2))
    return x

  return jax.tree.map(reborn, state, is_leaf=_is_count)


def _is_count(x) -> bool:
  counted = (optax.ScaleByScheduleState, RampState, optax.contrib.ScheduleFreeState)
  return isinstance(x, counted)


def _filled(x: jax.Array, value) -> jax.Array:
  return jax.device_put(jnp.full(x.shape, value, x.dtype), x.sharding)


def leaf_names(tree) -> list[str]:
  """Each leaf's path, its keys joined by "/" (as checkpoints name them), in flatten order."""
  flat, _ = jax.tree_util.tree_flatten_with_path(tree)
  return [_path_name(path) for path, _ in flat]


def moment_groups(table: dict) -> dict[str, dict[str, dict[str, str]]]:
  """``{prefix: {moment: {param path: leaf}}}``: every ``prefix/mu/...`` (and ``prefix/nu/...``)
  of a ``{name: (shape, dtype)}`` state table with the ``prefix/count`` that corrects them.

  Example:
    >>> moment_groups({"0/count": ((), "int32"), "0/mu/w": ((2,), "f32"), "0/nu/w": ((2,), "f32")})
    {'0': {'mu': {'w': '0/mu/w'}, 'nu': {'w': '0/nu/w'}}}
  """
  groups: dict[str, dict[str, dict[str, str]]] = {}
  for name in table:
    parts = name.split("/")
    at = next((i for i, part in enumerate(parts[:-1]) if part in _MOMENTS), None)
    if at is not None and _count("/".join(parts[:at])) in table:
      moments = groups.setdefault("/".join(parts[:at]), {})
      moments.setdefault(parts[at], {})["/".join(parts[at + 1 :])] = name
  return groups


def _count(prefix: str) -> str:
  return f"{prefix}/count" if prefix else "count"


def carried_leaves(saved: dict, new: dict) -> dict[str, str]:
  """``{new leaf: saved leaf}`` to carry between two state tables (``{name: (shape, dtype)}``).

  Each new :func:`moment_groups` group takes its moments and its count from one saved group
  that holds every moment it has (a count is carried only with every moment it corrects:
  Adam's ``count`` needs ``mu`` and ``nu``, Kron's, Lion's and Muon's only ``mu``) for each of
  its params, in the same shapes; a group no saved one fills is left as born (count 0).

  Example:
    >>> adam = {"0/count": ((), "int32"), "0/mu/w": ((2,), "f32"), "0/nu/w": ((2,), "f32")}
    >>> kron = {"0/count": ((), "int32"), "0/mu/w": ((2,), "f32"), "0/update_counter": ((), "int32")}
    >>> carried_leaves(adam, kron)
    {'0/mu/w': '0/mu/w', '0/count': '0/count'}
    >>> carried_leaves(kron, adam)  # Kron has no second moment: Adam's group is born afresh.
    {}
  """
  have = {p: g for p, g in moment_groups(saved).items() if _corrected(p, saved)}
  carried: dict[str, str] = {}
  for prefix, want in moment_groups(new).items():
    fits = lambda group, want=want: all(
        moment in group
        and all(
            param in group[moment] and saved[group[moment][param]][0] == new[leaf][0]
            for param, leaf in leaves.items()
        )
        for moment, leaves in want.items()
    )
    source = next((p for p, group in have.items() if fits(group)), None)
    if source is not None:
      for moment, leaves in want.items():
        carried.update({leaf: have[source][moment][param] for param, leaf in leaves.items()})
      carried[_count(prefix)] = _count(source)
  return carried


def _corrected(prefix: str, table: dict) -> bool:
  """Whether the count at ``prefix`` is known to bias-correct the ``mu`` beside it: a second
  moment (Adam's) or preconditioner factors (Kron's) lie beside them. Lion's count does not
  correct its ``mu`` (at step 20 it is 18% of the grads' mean), and Lion's and Muon's groups
  (``count`` and ``mu`` alone) cannot be told apart: neither is carried."""
  return any(name.startswith(f"{prefix}/{field}/") for name in table for field in _CORRECTED)


def carry(state, carried: dict[str, str], read: Callable[[dict], dict]) -> Any:
  """``state`` with the leaves ``carried`` names (new -> saved) replaced by the saved ones.

  ``read({saved name: new leaf})``: ``{saved name: array}`` in each new leaf's sharding. A
  saved leaf carried into several (Adam's ``count`` into Muon's and its inner Adam's) is read
  once and fills each with its own copy (:func:`own_buffers`).
  """
  names = leaf_names(state)
  leaves, treedef = jax.tree.flatten(state)
  new = dict(zip(names, leaves))
  values = read({saved: new[leaf] for leaf, saved in carried.items()}) if carried else {}
  filled = [values[carried[n]] if n in carried else x for n, x in zip(names, leaves)]
  return treedef.unflatten(own_buffers(filled, leaves))


def own_buffers(leaves: list, targets: list) -> list:
  """``leaves`` with each array that an earlier leaf already holds copied into its ``targets``
  leaf's sharding: every leaf its own buffer, as a step donating the state needs (one array in
  two leaves: "Attempt to donate the same buffer twice", then a segfault). Arrays are told
  apart by their buffers (``jax.device_put`` onto the same sharding gives another array on
  the same buffers).

  Example:
    >>> count = jnp.int32(12)
    >>> a, b = own_buffers([count, count], [count, count])
    >>> a is count, b is count, int(b)
    (True, False, 12)
  """
  held, owned = set(), []
  for x, target in zip(leaves, targets):
    key = _buffers(x)
    if key in held:
      x = jax.device_put(x, target.sharding, may_alias=False)
    held.add(key)
    owned.append(x)
  return owned


def _buffers(x) -> tuple:
  """The addresses of ``x``'s buffers on this host (its ``id`` where it has none)."""
  if not isinstance(x, jax.Array) or x.is_deleted():
    return (id(x),)
  return tuple(shard.data.unsafe_buffer_pointer() for shard in x.addressable_shards)


def renewed(names: list[str], kept: set[str], params: list[str]) -> list[str]:
  """The leaves of ``names`` not in ``kept``, each param path in them written ``*``, once each.

  Example:
    >>> renewed(["0/count", "0/nu/a/b", "0/nu/c", "1/count"], {"1/count"}, ["a/b", "c"])
    ['0/count', '0/nu/*']
  """
  longest_first = sorted(params, key=len, reverse=True)
  return list(dict.fromkeys(_starred(n, longest_first)[0] for n in names if n not in kept))


def _starred(name: str, longest_first: list[str]) -> tuple[str, str | None]:
  """``(name with its param path written *, that param path)``; ``(name, None)`` if none."""
  padded = f"/{name}/"
  param = next((p for p in longest_first if f"/{p}/" in padded), None)
  return (name, None) if param is None else (padded.replace(f"/{param}/", "/*/", 1)[1:-1], param)


def _first_moment(template: str) -> str | None:
  """The field of the first moment (a heavy-ball sum, or an EMA's ``mu``) a leaf's name (its
  param written ``*``) is part of, or None."""
  return next((f for f in template.split("/") if f in _HEAVY_BALLS or f == _MOMENTS[0]), None)


def _heavy_ball(template: str) -> str | None:
  """The field of the heavy-ball sum a leaf's name (its param written ``*``) is part of, or None."""
  return next((f for f in template.split("/") if f in _HEAVY_BALLS), None)


def heavy_ball_sources(saved: dict, new: dict, params: list[str]) -> dict[str, dict[str, str]]:
  """``{new leaf: {role: saved leaf}}``: each heavy-ball sum of a param in ``new`` (SGD's
  ``trace``, Shampoo's ``momentum``) and the saved leaves of that param, in the same shape, it
  is born from (:func:`born_sum`); both ``{name: (shape, dtype)}`` tables.

  Roles: ``"sum"``, a saved sum under the same field (it sums the same thing); else ``"mu"``
  and ``"count"`` of a saved :func:`moment_groups` group, with its ``"nu"`` for a sum of
  Adam-scaled directions (Shampoo's momentum of its grafted steps: Adam's direction is
  ``mu_hat / sqrt(nu_hat)``), else a ``mu`` alone or, as ``"grads"``, a saved sum of grads
  (SGD's trace; :func:`in_grad_units`); a sum of grads (``trace``) takes any ``mu`` (an EMA of
  the grads).

  Example:
    >>> adam = {"0/count": ((), "int32"), "0/mu/w": ((2,), "f32"), "0/nu/w": ((2,), "f32")}
    >>> heavy_ball_sources(adam, {"1/0/trace/w": ((2,), "f32")}, ["w"])
    {'1/0/trace/w': {'mu': '0/mu/w', 'count': '0/count'}}
    >>> lion = {"0/count": ((), "int32"), "0/mu/w": ((2,), "f32")}
    >>> heavy_ball_sources(lion, {"0/per_param/w/momentum": ((2,), "f32")}, ["w"])
    {'0/per_param/w/momentum': {'mu': '0/mu/w', 'count': '0/count'}}
  """
  longest_first = sorted(params, key=len, reverse=True)
  sums = {}
  for name, (shape, _) in saved.items():
    template, param = _starred(name, longest_first)
    if _heavy_ball(template) is not None:
      sums[_heavy_ball(template), param, shape] = name
  groups = moment_groups(saved)
  sources = {}
  for name, (shape, _) in new.items():
    template, param = _starred(name, longest_first)
    field = _heavy_ball(template)
    if field is None:
      continue
    if (field, param, shape) in sums:
      sources[name] = {"sum": sums[field, param, shape]}
      continue
    # A sum of grafted steps takes Adam's direction where a group has it, else a first
    # moment alone, born in the gradients' units (:func:`in_grad_units`).
    choices = (("mu",),) if _HEAVY_BALLS[field] is None else (("mu", "nu"), ("mu",))
    for wanted in choices:
      prefix = _holding(groups, wanted, param, shape, saved)
      if prefix is not None:
        group = groups[prefix]
        sources[name] = {**{m: group[m][param] for m in wanted}, "count": _count(prefix)}
        break
    if name not in sources and (_GRADS, param, shape) in sums:  # SGD's trace: a first moment.
      sources[name] = {"grads": sums[_GRADS, param, shape]}
  return sources


def _holding(groups: dict, wanted: tuple, param: str, shape: tuple, saved: dict) -> str | None:
  """The first group of ``groups`` holding every moment ``wanted`` of ``param`` in ``shape``."""
  fits = lambda group: all(
      param in group.get(m, {}) and saved[group[m][param]][0] == shape for m in wanted
  )
  return next((prefix for prefix, group in groups.items() if fits(group)), None)


def born_sum(values: dict, decays: dict, beta: float) -> jax.Array:
  """A heavy-ball sum ``m = beta m + d`` as a run summing all along holds it, from the saved
  ``values`` (``{role: array}``, :func:`heavy_ball_sources`' roles): its steady state
  ``E[d] / (1 - beta)``. ``E[d]`` is a saved sum's ``(1 - decay) m``, or the saved ``mu``
  bias-corrected by its ``count``, divided by the square root of the bias-corrected ``nu``
  where one is given (Adam's direction); ``decays``: each role's (``{role: decay}``).

  Example:
    >>> born_sum({"mu": jnp.array([1.0, -1.0]), "count": 1}, {"mu": 0.0}, 0.5).tolist()
    [2.0, -2.0]
    >>> adam = {"mu": jnp.array([0.5, 0.0]), "nu": jnp.array([0.5, 0.0]), "count": 1}
    >>> born_sum(adam, {"mu": 0.5, "nu": 0.5}, 0.5).tolist()
    [2.0, 0.0]
    >>> born_sum({"sum": jnp.array([4.0])}, {"sum": 0.75}, 0.5).tolist()
    [2.0]
  """
  if "sum" in values:
    return values["sum"].astype(jnp.float32) * (1.0 - decays["sum"]) / (1.0 - beta)
  if "grads" in values:
    return values["grads"].astype(jnp.float32) * (1.0 - decays["grads"]) / (1.0 - beta)
  count = jnp.maximum(values["count"], 1)
  mean = values["mu"].astype(jnp.float32) / (1.0 - decays["mu"] ** count)
  if "nu" in values:
    nu_hat = values["nu"].astype(jnp.float32) / (1.0 - decays["nu"] ** count)
    mean = jnp.where(nu_hat > 0, mean / jnp.sqrt(jnp.where(nu_hat > 0, nu_hat, 1.0)), 0.0)
  return mean / (1.0 - beta)


def source_decays(field: str, new: dict, saved: dict) -> dict[str, float]:
  """``{role: decay}`` for a sum under ``field`` born from saved leaves: each role's decay as
  the saving run recorded it (``saved``, by field), else the new optimizer's (``new``) for it,
  as for a checkpoint that recorded none.

  Example:
    >>> source_decays("momentum", {"momentum": 0.9, "graft_nu": 0.99}, {"mu": 0.8})
    {'sum': 0.9, 'grads': 0.9, 'mu': 0.8, 'nu': 0.99}
  """
  recorded = {"sum": field, "grads": _GRADS, "mu": "mu", "nu": "nu"}
  stands_for = {"sum": field, "grads": field, "mu": field, "nu": _HEAVY_BALLS[field]}
  return {r: saved.get(recorded[r], new.get(stands_for[r])) for r in recorded}


def heavy_balls(state, sources: dict, read: Callable[[dict], dict], decays: tuple) -> Any:
  """``state`` with each heavy-ball leaf ``sources`` names :func:`born_sum` of its saved
  leaves (``read`` as for :func:`carry`), in its dtype and sharding; ``decays``: ``(new,
  saved)`` by field, as :func:`reborn` takes them."""
  if not sources:
    return state
  names = leaf_names(state)
  leaves, treedef = jax.tree.flatten(state)
  new = dict(zip(names, leaves))
  scalar = next(x for x in leaves if x.ndim == 0)  # A target for the counts: replicated.
  targets = {
      saved: scalar if role == "count" else new[leaf]
      for leaf, roles in sources.items()
      for role, saved in roles.items()
  }
  values = read(targets)

  def born(name, x):
    field = _heavy_ball(name)
    got = {role: values[saved] for role, saved in sources[name].items()}
    summed = born_sum(got, source_decays(field, *decays), decays[0][field])
    return jax.device_put(summed.astype(x.dtype), x.sharding)

  return treedef.unflatten([born(n, x) if n in sources else x for n, x in zip(names, leaves)])


def in_grad_units(sources: dict, names: list[str]) -> list[str]:
  """The second-moment leaves (``graft_nu``) beside the sums of grafted steps (Shampoo's
  ``momentum``) that ``sources`` bears from a first moment alone: such a sum is born in the
  gradients' units (no second moment to divide by), and its second moment filled with
  :data:`~bv_sharding.optimizers.shampoo.GRAD_UNITS` marks it so; Shampoo divides the sum by
  its param's first gradient's RMS at its first update.

  Example:
    >>> lion = {"0/per_param/w/momentum": {"mu": "0/mu/w", "count": "0/count"}}
    >>> in_grad_units(lion, ["0/per_param/w/graft_nu", "0/per_param/w/momentum"])
    ['0/per_param/w/graft_nu']
  """
  marked = []
  for name, roles in sources.items():
    field = _heavy_ball(name)
    if _HEAVY_BALLS[field] is not None and not {"sum", "nu"} & set(roles):
      parts = name.split("/")
      parts[parts.index(field)] = _HEAVY_BALLS[field]
      marked += [n for n in ["/".join(parts)] if n in names]
  return marked


class RefillState(NamedTuple):
  """Per param, the terms its first moment has taken since a birth at zero: 0 at such a
  birth, :data:`FULL` (int32's largest, where it stays) in a fresh run, whose moment is full."""

  terms: Any


def refill_scale(missing) -> jax.Array:
  """The scale of an update from a heavy-ball sum missing the weight ``missing`` (``beta^n``).

  ``n`` terms into a sum born at zero, a sum of alike terms holds ``1 - beta^n`` of a full one,
  a sum of independent zero-mean ones ``sqrt(1 - beta^2n)`` of its norm; the scale is the
  geometric mean of the two corrections, within ``((1 + beta) / (1 - beta)) ** 0.25`` of
  either (2.09x at ``beta`` 0.9, at the first step; 1 at ``missing`` 0).

  Example:
    >>> [round(float(refill_scale(m)), 2) for m in (0.0, 0.9, 0.9**5)]
    [1.0, 4.79, 1.74]
  """
  return (1.0 - missing) ** -0.5 * (1.0 - jnp.square(missing)) ** -0.25


def refill(beta: float, corrected: bool = False) -> optax.GradientTransformation:
  """Scales each param's updates by :func:`refill_scale` of the weight its first moment
  (decay ``beta``) misses: none in a fresh run; a heavy-ball sum :func:`reborn` leaves at zero
  (no saved leaf gives it) starts at a full sum's scale, and the scale falls to 1 as it fills.

  ``corrected``: the updates come from an EMA that Adam's bias correction ``1 / (1 - beta^n)``
  fills as if its terms were alike (SOAP's ``mu``); the refill's replaces it, and the updates
  are scaled by ``(1 - beta^n) refill_scale(beta^n) = ((1 - beta^n) / (1 + beta^n)) ** 0.25``
  (0.40 at the first step at ``beta`` 0.95): a fresh run's correction is the optimizer's own.

  Example:
    >>> fresh = refill(0.5).init({"w": 0})
    >>> at_zero = RefillState({"w": jnp.int32(0)})  # As reborn marks a moment born at zero.
    >>> first = lambda tx, s: round(float(tx.update({"w": jnp.ones(1)}, s)[0]["w"][0]), 2)
    >>> [first(refill(0.5), s) for s in (fresh, at_zero)], first(refill(0.5, True), at_zero)
    ([1.0, 1.52], 0.76)
  """

  def init(params):
    return RefillState(jax.tree.map(lambda _: jnp.full([], FULL, jnp.int32), params))

  def update(updates, state, params=None):
    del params
    counts, treedef = jax.tree.flatten(state.terms)
    if not counts:
      return updates, state
    # Every param's scale in one vector, each then its own scalar (opaque.apart): the scalar
    # math once, not once per param (Shampoo on lm medium: 2,700 of its step's instructions).
    terms = [optax.safe_increment(n) for n in counts]
    missing = beta ** jnp.stack(terms).astype(jnp.float32)
    scales = refill_scale(missing) * (1.0 - missing if corrected else 1.0)
    like = jax.ShapeDtypeStruct((), scales.dtype)
    each = opaque.apart(lambda j: scales[j], len(counts), like)
    scaled = [(u * s).astype(u.dtype) for u, s in zip(treedef.flatten_up_to(updates), each)]
    return treedef.unflatten(scaled), RefillState(treedef.unflatten(terms))

  return optax.GradientTransformation(init, update)


def unfilled(state, params: set[str]) -> tuple[Any, bool]:
  """``(state, refilled)``: ``state`` with each :class:`RefillState` marking the first moments
  of ``params`` (their paths) born at zero (0 terms), the others full (:data:`FULL`);
  ``refilled``: whether it has one.
  """
  marked = []

  def mark(x):
    if not isinstance(x, RefillState):
      return x
    marked.append(x)
    at = lambda path, n: _filled(n, 0 if _path_name(path) in params else FULL)
    return RefillState(jax.tree_util.tree_map_with_path(at, x.terms))

  state = jax.tree.map(mark, state, is_leaf=lambda x: isinstance(x, RefillState))
  return state, bool(marked)


def _path_name(path) -> str:
  return jax.tree_util.keystr(path, simple=True, separator="/")


# How a first moment born at zero and refilled is listed among the leaves born afresh.
REFILLED = " (at zero; its updates at a full one's scale while it fills: rebirth.refill)"
# How a SOAP count born at 1 (:func:`moving`) is listed among them.
MOVING = " (at 1: SOAP fits its bases on its first step and moves, where a fresh run only fits)"


def moving(state):
  """``state`` with each SOAP count at 1: SOAP's first step (count 0) only fits its statistics
  and bases, as the authors' reference does at a run's start; born mid-run it moves from its
  first step, fitting them as it goes (``soap.py``).

  Example:
    >>> import jax.numpy as jnp
    >>> from bv_sharding.optimizers.soap import scale_by_soap
    >>> int(moving(scale_by_soap().init({"w": jnp.ones((2, 2))})).count)
    1
  """
  born = lambda x: x._replace(count=_filled(x.count, 1)) if isinstance(x, SoapState) else x
  return jax.tree.map(born, state, is_leaf=lambda x: isinstance(x, SoapState))


def reborn(state, step: int, saved: dict, read, params, learning_rate=None, decays=({}, {})):
  """``(state, carried, renewed)``: a state just born at ``step``, its schedules and ramp
  reborn there (:func:`at_step`), the saved moments that fit it carried (:func:`carried_leaves`)
  and its heavy-ball sums born full from saved leaves (:func:`heavy_ball_sources`); its first
  moments no saved leaf gives at zero and refilled (:func:`refill`, where its optimizer chains
  one), and SOAP's count at 1 (:func:`moving`).

  ``saved``: the saving run's state table ``{leaf: (shape, dtype)}``; ``read``: as for
  :func:`carry`; ``params``: the params' tree (its paths name the params); ``learning_rate``:
  as for :func:`at_step`; ``decays``: ``(new, saved)``, the new optimizer's and the saving
  one's decays by field (``registry.state_decays``; the saving one's as its checkpoint
  recorded them, ``{}`` if it did not): a sum is born full only with the new one's ``beta``;
  ``carried``: ``{new leaf: saved leaf}``, each born sum's first source included;
  ``renewed``: the leaves left as born (:func:`renewed`), neither carried nor set by
  :func:`at_step`, a refilled moment marked :data:`REFILLED` and SOAP's count :data:`MOVING`.
  """
  names, paths = leaf_names(state), leaf_names(params)
  table = {n: (tuple(x.shape), str(x.dtype)) for n, x in zip(names, jax.tree.leaves(state))}
  carried = carried_leaves(saved, table)
  sources = heavy_ball_sources(saved, table, paths).items()
  summed = {leaf: roles for leaf, roles in sources if _heavy_ball(leaf) in decays[0]}
  longest_first = sorted(paths, key=len, reverse=True)
  starred = {n: _starred(n, longest_first) for n in names}
  firsts = {n for n, (template, _) in starred.items() if _first_moment(template)}
  empty = {starred[n][1] for n in firsts - set(summed) - set(carried)}
  stepped, refilled = unfilled(at_step(state, step, learning_rate), empty)
  moved = _changed(names, state, stepped)
  state = moving(stepped)
  fitting = _changed(names, stepped, state)
  state = heavy_balls(carry(state, carried, read), summed, read, decays)
  marked = in_grad_units(summed, names)
  leaves, treedef = jax.tree.flatten(state)
  state = treedef.unflatten(
      [_filled(x, GRAD_UNITS) if n in marked else x for n, x in zip(names, leaves)]
  )
  kept = set(carried) | set(summed) | moved
  carried = {**carried, **{leaf: next(iter(roles.values())) for leaf, roles in summed.items()}}
  left = renewed(names, kept, paths)
  notes = lambda n: REFILLED if refilled and _first_moment(n) else MOVING if n in fitting else ""
  return state, carried, [n + notes(n) for n in left]


def _changed(names: list[str], before, after) -> set[str]:
  """The names of the leaves of ``after`` that are not those of ``before`` (flatten order)."""
  pairs = zip(names, jax.tree.leaves(before), jax.tree.leaves(after))
  return {n for n, a, b in pairs if a is not b}
