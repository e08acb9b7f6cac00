"""Optimizer registry: build any supported optimizer from a name and config.

Names: optax's adamw, adafactor, lion, sgd, lamb and schedule_free, and the project's
kron (PSGD Kron), shampoo, soap and muon (``kron.py``, ``shampoo.py``, ``soap.py``,
``muon.py``); each
with decoupled weight decay, clipping and a schedule (:func:`make_optimizer`).

Example:
    >>> import jax.numpy as jnp
    >>> tx = make_optimizer("adamw", 1e-3, weight_decay=0.05, clip_norm=1.0,
    ...                     schedule=dict(total_steps=1000, warmup_steps=100))
    >>> params = {"dense": {"kernel": jnp.ones((4, 4)), "bias": jnp.zeros(4)}}
    >>> updates, state = tx.update(params, tx.init(params), params)
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping
from typing import Any

import jax
import optax

from bv_sharding.big_vision.schedules import make_schedule
from bv_sharding.big_vision.transformations import mistyped
from bv_sharding.optimizers import (
    SOAP_LR_SCALE,
    auto_axes_update,
    kron,
    muon,
    refill,
    shampoo,
    soap,
)
from trainers.errors import OptimizerError, closest

# Last path components of norm scales and biases: small vectors that get no weight decay.
_NO_DECAY_NAMES = frozenset({"scale", "bias"})


def decay_mask(params: optax.Params) -> Any:
  """True for leaves that get weight decay: ndim >= 2, not named scale/bias.

  Example:
      >>> import jax.numpy as jnp
      >>> decay_mask({"ln": {"scale": jnp.ones((2, 2))}, "w": jnp.ones((2, 2)),
      ...             "b": jnp.ones(2)})
      {'b': False, 'ln': {'scale': False}, 'w': True}
  """

  def wants_decay(path, leaf):
    name = jax.tree_util.keystr(path[-1:], simple=True) if path else ""
    return leaf.ndim >= 2 and name not in _NO_DECAY_NAMES

  return jax.tree_util.tree_map_with_path(wants_decay, params)


def schedule_free_adamw(
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    mask: Any | None = None,
    weight_lr_power: float = 2.0,
) -> optax.GradientTransformation:
  """``optax.contrib.schedule_free`` around AdamW (with a weight-decay mask).

  Evaluate with ``optax.contrib.schedule_free_eval_params(state, params)``.
  """
  base = optax.adamw(learning_rate, b1=0.0, b2=b2, eps=eps, weight_decay=weight_decay, mask=mask)
  return optax.contrib.schedule_free(base, learning_rate, b1=b1, weight_lr_power=weight_lr_power)


@dataclasses.dataclass(frozen=True)
class _Entry:
  """How to build one optimizer.

  factory: called as ``factory(learning_rate, **kwargs)``.
  decay_args: names of its (weight decay, mask) arguments; None if it has
    none, and weight decay is then added to the gradient before it.
  defaults: keyword defaults that differ from the factory's (optax's; the project's own
    optimizers have the registry's defaults as their own).
  lr_scale: the learning rate (or schedule) given is multiplied by this, so one
    ``config.lr`` suits every optimizer (SOAP's: its published ``soap.LR_SCALE``).
  decays: the decay of each EMA (``mu``, ``nu``, ``graft_nu``) and heavy-ball sum
    ``m = beta m + d`` (``trace``, ``momentum``) in its state, by the field it lies under: the
    argument that sets it, or a number. Recorded with its checkpoints, so that a state born
    mid-run from them reads each saved moment in its units (rebirth.py); a field whose groups
    decay alike by different arguments (Muon's ``mu``) is left out.
  own_mu: the decay, read from the factory's arguments, of a bias-corrected first moment that
    lies in the optimizer's own bases (SOAP's ``mu``): never carried, so refilled when born
    mid-run (:func:`_refilled`); None where there is none.
  """

  factory: Callable[..., optax.GradientTransformation]
  decay_args: tuple[str, str] | None = ("weight_decay", "mask")
  defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  lr_scale: float = 1.0
  decays: Mapping[str, str | float] = dataclasses.field(default_factory=dict)
  own_mu: Callable[[Mapping[str, Any]], float] | None = None


_REGISTRY: dict[str, _Entry] = {
    "adamw": _Entry(optax.adamw, decays={"mu": "b1", "nu": "b2"}),
    "adafactor": _Entry(optax.adafactor, ("weight_decay_rate", "weight_decay_mask")),
    "lion": _Entry(optax.lion, decays={"mu": "b2"}),  # b1 only interpolates its step.
    "sgd": _Entry(optax.sgd, None, {"momentum": 0.9}, decays={"trace": "momentum"}),
    "lamb": _Entry(optax.lamb, decays={"mu": "b1", "nu": "b2"}),
    # The project's Muon: scanned (L, m, n) kernels orthogonalised per layer, and with the
    # trainer's layout each matrix orthogonalised once, by its owner device (muon.py); each
    # matrix update scaled to muon.CONSISTENT_RMS, the other leaves trained with Adam.
    "muon": _Entry(muon, ("weight_decay", "weight_decay_mask")),
    # Its base Adam's b1 is 0 (mu is the last grad); its b1 interpolates the averages.
    "schedule_free": _Entry(schedule_free_adamw, decays={"mu": 0.0, "nu": "b2"}),
    # Kron, Shampoo and SOAP at their own defaults (their docstrings give the measurements):
    # blocks of 256,
    # Shampoo grafted on Adam after 10 graft-only steps, its step the average of its
    # momentum, each tile's roots refreshed every 10 steps (a tenth of the tiles each step),
    # params with a dim over 4096 (a vocabulary) on Adam's direction alone,
    # SOAP's bases following its statistics continuously (power_damping).
    "kron": _Entry(kron, decays={"mu": "b1"}),
    "shampoo": _Entry(shampoo, decays={"momentum": "beta1", "graft_nu": "beta2"}),
    # SOAP (Adam in the eigenbasis of Shampoo's statistics, on Shampoo's tiles): the authors'
    # betas, refresh every 10 steps and weight decay after the step, at soap.LR_SCALE times
    # config.lr. Its moments lie in the rotated basis: no decays recorded, so a state born
    # from another optimizer's moments starts at zero, its mu refilled (own_mu), and moves
    # from its first step (rebirth.moving).
    "soap": _Entry(
        soap,
        ("weight_decay", "mask"),
        lr_scale=SOAP_LR_SCALE,
        own_mu=lambda args: args["betas"][0],
    ),
}
OPTIMIZERS = tuple(_REGISTRY)
# With the params' layout, Kron's, Shampoo's and SOAP's pools of tiles padded to at most 1.5x
# their tiles keep their state where they run (``resident_padding``): 8 devices' pools of lm
# small do, and SOAP's step moves 1.11x adamw's bytes instead of 1.82x, Shampoo's (its roots
# kept) 1.15x instead of 1.55x on lm tiny. Their state's shapes then follow the
# mesh; the trainer's checkpoints store it given back to the params (trainers/stored.py).
RESIDENT_PADDING = 1.5


def lr_scale(name: str) -> float:
  """The factor registry optimizer ``name`` applies to the learning rate it is given.

  Example:
    >>> lr_scale("adamw"), lr_scale("shampoo"), lr_scale("soap")
    (1.0, 1.0, 2.0)
  """
  return _lookup(name).lr_scale


def state_decays(name: str, kwargs: Mapping[str, Any]) -> dict[str, float]:
  """The decays of the EMAs and heavy-ball sums in the state of ``name`` built with ``kwargs``
  (its ``config.optax``), by the field they lie under; ``{}`` for an optimizer outside the
  registry. A sum switched off (``momentum=None``) is left out.

  Example:
    >>> state_decays("sgd", {}), state_decays("shampoo", {"beta1": 0.8})
    ({'trace': 0.9}, {'momentum': 0.8, 'graft_nu': 0.999})
    >>> state_decays("lion", {}), state_decays("scale_by_adam", {})
    ({'mu': 0.99}, {})
  """
  entry = _REGISTRY.get(name)
  if entry is None:
    return {}
  values = _arguments(entry, kwargs)
  decays = {field: values[v] if isinstance(v, str) else v for field, v in entry.decays.items()}
  return {field: float(decay) for field, decay in decays.items() if decay is not None}


def _refilled(name: str, kwargs: Mapping[str, Any]) -> optax.GradientTransformation | None:
  """:func:`~bv_sharding.optimizers.rebirth.refill` of the first moment of ``name`` built with
  ``kwargs``: its updates at a full one's scale after a birth at zero mid-run (none in a fresh
  run), for a heavy-ball sum (sgd's ``trace``, shampoo's ``momentum``) and soap's bias-corrected
  ``mu``; None for the others.

  Example:
    >>> [_refilled(name, {}) is None for name in ("sgd", "shampoo", "soap", "adamw")]
    [False, False, False, True]
  """
  decays = state_decays(name, kwargs)
  beta = decays.get("trace", decays.get("momentum"))
  if beta is not None:
    return refill(beta)
  entry = _REGISTRY[name]
  if entry.own_mu is not None:
    return refill(entry.own_mu(_arguments(entry, kwargs)), corrected=True)
  return None


def _arguments(entry: _Entry, kwargs: Mapping[str, Any]) -> dict[str, Any]:
  """Every argument of ``entry``'s factory as ``kwargs`` (its ``config.optax``) sets it."""
  signature = inspect.signature(entry.factory).parameters
  return {**{a: p.default for a, p in signature.items()}, **entry.defaults, **kwargs}


def _scaled(learning_rate: optax.ScalarOrSchedule, scale: float) -> optax.ScalarOrSchedule:
  if callable(learning_rate):
    return lambda step: scale * learning_rate(step)
  return scale * learning_rate


def _lookup(name: str) -> _Entry:
  if name in _REGISTRY:
    return _REGISTRY[name]
  raise OptimizerError(
      f"Unknown optimizer {name!r}{closest(name, OPTIMIZERS)} Available: {', '.join(OPTIMIZERS)}."
  )


def _check_arguments(name: str, entry: _Entry, kwargs: Mapping[str, Any]) -> None:
  signature = inspect.signature(entry.factory)
  try:
    signature.bind(None, **kwargs)
  except TypeError as e:
    unknown = sorted(set(kwargs) - set(signature.parameters))
    hints = "".join(closest(arg, signature.parameters) for arg in unknown)
    raise OptimizerError(
        f"Bad arguments for optimizer {name!r}: {e}{hints}. Signature: {name}{signature}"
    ) from None
  wrong = mistyped(signature, kwargs)
  if wrong:
    raise OptimizerError(f"optimizer {name!r}: {wrong}")
  for arg in (a for a in entry.decays.values() if isinstance(a, str)):
    value = kwargs.get(arg, signature.parameters[arg].default)
    if value is not None and not 0 <= value < 1:
      raise OptimizerError(
          f"{arg}={value!r} of optimizer {name!r}: a decay must be in [0, 1) (at 1 an average "
          "never forgets and its bias correction divides by zero; above 1 it grows without bound)"
      )


def make_optimizer(
    name: str,
    learning_rate: optax.ScalarOrSchedule,
    *,
    schedule: Mapping[str, Any] | None = None,
    weight_decay: float = 0.0,
    weight_decay_mask: Any = decay_mask,
    clip_norm: float | None = None,
    layout: Any = None,
    **optimizer_kwargs,
) -> optax.GradientTransformation:
  """Builds optimizer ``name`` (one of ``OPTIMIZERS``).

  Args:
    name: registry name, e.g. "adamw", "kron", "shampoo".
    learning_rate: float or optax schedule; with ``schedule`` the peak value.
    schedule: kwargs of :func:`make_schedule` (``total_steps`` and big_vision's
      ``decay_type``, ``warmup_steps``, ``linear_end``, ...), or None for a constant.
    weight_decay: decoupled weight decay (for "sgd": added to the gradient).
    weight_decay_mask: pytree of bools or callable; default skips
      ``scale``/``bias`` leaves and leaves with ndim < 2.
    clip_norm: clip gradients to this global norm first (None: no clipping).
    layout: the params' :class:`~bv_sharding.optimizers.layout.ParamLayout`, given to
      optimizers that take a ``layout`` (Kron, Shampoo: where each fixed tile is fitted and
      its factors stored, or shard-local blocks with ``blocking="local"``; Muon: each
      matrix orthogonalised by its owner device; Kron's, Shampoo's and SOAP's pools then kept
      where they run, ``resident_padding`` :data:`RESIDENT_PADDING` unless given); the others
      ignore it.
    **optimizer_kwargs: passed to the optimizer's own constructor.

  On a mesh with Explicit axes the update runs in Auto axes and returns its results in
  the gradients' and the state's shardings (``axes.py``): the same update as on Auto axes.

  Raises:
    OptimizerError: unknown name (lists names and the closest match) or
      arguments the constructor does not take (shows its signature).

  Example:
      >>> tx = make_optimizer("kron", 3e-4, preconditioner_update_probability=1.0)
      >>> make_optimizer("adamww", 1e-3)
      Traceback (most recent call last):
      ...
      bv_sharding.errors.OptimizerError: Unknown optimizer 'adamww'; did you mean 'adamw'? ...
  """
  entry = _lookup(name)
  reserved = set(entry.decay_args or ()) & set(optimizer_kwargs)
  if reserved:
    raise OptimizerError(f"Pass {sorted(reserved)} of {name!r} as weight_decay/weight_decay_mask.")
  kwargs = {**entry.defaults, **optimizer_kwargs}
  taken = inspect.signature(entry.factory).parameters
  if layout is not None and "layout" in taken:
    kwargs["layout"] = layout
    if "resident_padding" in taken:  # The trainer's checkpoints store the pools given back.
      kwargs.setdefault("resident_padding", RESIDENT_PADDING)
  if entry.decay_args is not None:
    kwargs.update(zip(entry.decay_args, (weight_decay, weight_decay_mask)))
  _check_arguments(name, entry, kwargs)
  if schedule is not None:
    learning_rate = make_schedule(learning_rate, **schedule)
  if entry.lr_scale != 1.0:
    learning_rate = _scaled(learning_rate, entry.lr_scale)
  transforms = [
      optax.clip_by_global_norm(clip_norm) if clip_norm is not None else None,
      optax.add_decayed_weights(weight_decay, weight_decay_mask)
      if entry.decay_args is None and weight_decay
      else None,
      entry.factory(learning_rate, **kwargs),
      _refilled(name, optimizer_kwargs),
  ]
  return auto_axes_update(optax.chain(*[t for t in transforms if t is not None]))
