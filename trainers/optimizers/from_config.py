"""The optimizer section of a config, read as big_vision reads it, next to the project's names.

``config.optax_name`` is either a name of this project's registry (``adamw``,
``kron``, ``shampoo``, ``muon``, ...: :func:`make_optimizer`, which takes the
learning rate and ``config.wd`` itself) or any optax attribute, dotted or not
(``"scale_by_adam"``, ``"adafactor"`` when written ``"optax.adafactor"``,
``"contrib.scale_by_muon"``), built as big_vision's ``optax.make`` builds it::

    clip(grad_clip_norm) -> optax_name(**config.optax) -> scale(lr) -> lr_mults
    -> + wd * mult * param on wd_mults' leaves (default ".*/kernel$")
    -> x schedule(step) per (regex, schedule) of config.schedule -> negate

so ``config.wd`` is decoupled, applied after the learning rate (not multiplied
by it) and scaled by the schedule; a ``None`` schedule freezes the leaves it
matches. Regexes fullmatch ``/``-joined param names; the first match wins.

Either way the optimizer's floating-point state is stored in ``config.state_dtype``
(default: ``config.param_dtype``) and updated in float32
(:func:`~trainers.optimizers.state_dtype.with_state_dtype`); a dtype argument in
``config.optax`` (``mu_dtype``, Kron's ``precond_dtype``) wins for what it names.

Example:
  >>> from configs.common import base_config
  >>> config = base_config()
  >>> config.optax_name, config.lr, config.total_steps = "scale_by_adam", 1e-3, 100
  >>> config.schedule = dict(decay_type="cosine", warmup_steps=10)
  >>> tx, lrs = from_config(config)
  >>> [round(float(lrs["lr"](step)), 6) for step in (0, 5, 10, 100)]  # warmup, then cosine
  [0.0, 0.0005, 0.001, 0.0]
"""

from __future__ import annotations

import inspect
import operator
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import optax

from bv_sharding.ops import flatten_with_names
from trainers import precision
from trainers.errors import OptimizerError, nearest
from trainers.optimizers import rebirth, registry
from trainers.optimizers.schedules import make_schedule
from trainers.optimizers.state_dtype import with_state_dtype

DEFAULT_WD_MULTS = ((".*/kernel$", 1.0),)
_BIG_VISION_OWN = {  # big_vision's own optax.big_vision.* names: no optax attribute to build.
    "big_vision.scale_by_adafactor": "scale_by_factored_rms",
    "big_vision.momentum_hp": "trace",
    "big_vision.sgd": "identity",
}


def from_config(config, layout=None) -> tuple[optax.GradientTransformation, dict[str, Callable]]:
  """``(tx, learning_rates)`` from ``config.optax_name``, ``optax``, ``lr``, ``wd``,
  ``schedule``, ``grad_clip_norm`` (and big_vision's ``lr_mults``/``wd_mults``).

  ``learning_rates`` maps ``"lr"`` (and ``"lr1"``, ``"lr2"``, ... for further
  ``(regex, schedule)`` entries) to ``step -> learning rate``: the very
  schedules the optimizer applies, for logging (a registry optimizer's ``lr_scale``
  included). ``layout``: the params' :class:`~trainers.optimizers.layout.ParamLayout`, for
  the project's optimizers that follow the params' layout: Kron and Shampoo fit each of a
  param's fixed tiles where its shards are (or cut shard-local blocks with
  ``blocking="local"``), Muon orthogonalises each matrix on an owner device.
  The state is stored in ``config.state_dtype`` (see the module docstring).
  """
  name = config.optax_name
  kwargs = _plain(config.get("optax") or {})
  entries = _schedule_entries(config)
  schedules = [None if sched is None else _schedule(config, sched) for _, sched in entries]
  peak = config.lr * (registry.lr_scale(name) if name in registry.OPTIMIZERS else 1.0)
  learning_rates = {
      f"lr{i or ''}": (lambda step, s=s: peak * s(step))
      for i, s in enumerate(s for s in schedules if s is not None)
  }
  if name in registry.OPTIMIZERS:
    tx = _registry_optimizer(config, name, kwargs, entries, schedules, layout)
  else:
    tx = _optax_chain(config, _optax_factory(name, kwargs), entries, schedules)
  tx = with_state_dtype(tx, precision.of_config(config).state)
  if config.get("rewarmup_steps"):  # Ramps in an optimizer born mid-run (rebirth.py).
    tx = optax.chain(tx, rebirth.ramp_in(config.rewarmup_steps))
  return tx, learning_rates


def _registry_optimizer(config, name, kwargs, entries, schedules, layout):
  if len(entries) != 1 or schedules[0] is None:
    raise OptimizerError(
        f"config.schedule lists {len(entries)} (regex, schedule) entries or freezes params; "
        f"the project's optimizer {name!r} takes one schedule. Use one dict, or an optax "
        "transformation as config.optax_name (e.g. 'scale_by_adam'), as big_vision does"
    )
  try:
    return registry.make_optimizer(
        name,
        lambda step: config.lr * schedules[0](step),
        weight_decay=config.get("wd") or 0.0,
        clip_norm=config.get("grad_clip_norm"),
        layout=layout,
        **kwargs,
    )
  except OptimizerError as e:
    raise OptimizerError(f"config.optax_name / config.optax: {e}") from None


def _optax_factory(name: str, kwargs: dict) -> optax.GradientTransformation:
  if name in _BIG_VISION_OWN:
    raise OptimizerError(
        f"config.optax_name={name!r} is big_vision's own optimizer, not an optax attribute; "
        f"write its optax counterpart, e.g. {_BIG_VISION_OWN[name]!r}, with config.optax"
    )
  path = name.removeprefix("optax.")
  try:
    factory = operator.attrgetter(path)(optax)
  except AttributeError:
    close = nearest(path, [*registry.OPTIMIZERS, *dir(optax)])
    hint = f" Did you mean {close!r}?" if close else ""
    raise OptimizerError(
        f"config.optax_name={name!r} is neither one of the project's optimizers "
        f"({', '.join(registry.OPTIMIZERS)}) nor an optax attribute.{hint}"
    ) from None
  try:
    inspect.signature(factory).bind(**kwargs)
  except TypeError as e:
    raise OptimizerError(
        f"config.optax={kwargs} for config.optax_name={name!r}: {e}. "
        f"Signature: {path}{inspect.signature(factory)}"
    ) from None
  return factory(**kwargs)


def _optax_chain(config, tx, entries, schedules):
  patterns = [regex for regex, _ in entries]
  frozen = [s is None for s in schedules]
  is_frozen = lambda matches: any(m and f for m, f in zip(matches, frozen))
  frozen_mask = _mask(patterns, is_frozen, cover=True)
  trainable = _mask(patterns, lambda matches: not is_frozen(matches), cover=True)
  clip = config.get("grad_clip_norm")
  lr_mults = _pairs(config, "lr_mults", ())
  wd = config.get("wd") or 0.0
  wd_mults = _pairs(config, "wd_mults", DEFAULT_WD_MULTS) if wd else ()
  return optax.chain(
      optax.masked(optax.clip_by_global_norm(clip), trainable) if clip else optax.identity(),
      optax.masked(tx, trainable),
      optax.scale(config.lr),
      *[optax.masked(optax.scale(m), _nth(lr_mults, i)) for i, (_, m) in enumerate(lr_mults)],
      *[optax.add_decayed_weights(wd * m, _nth(wd_mults, i)) for i, (_, m) in enumerate(wd_mults)],
      *[
          optax.masked(optax.scale_by_schedule(s), _nth(entries, i, cover=True))
          for i, s in enumerate(schedules)
          if s is not None
      ],
      optax.masked(optax.set_to_zero(), frozen_mask),
      optax.scale(-1.0),
  )


def _schedule_entries(config) -> tuple[tuple[str, Any], ...]:
  """``config.schedule`` as ``(regex, dict | None)`` pairs; a lone dict covers ``".*"``;
  no ``schedule`` key is big_vision's default, a constant learning rate."""
  schedule = config.get("schedule", {})
  if schedule is None:
    raise OptimizerError(
        "config.schedule is None; big_vision freezes such params. Write "
        'dict(decay_type="stair") for a constant learning rate, or list (regex, None) '
        "pairs to freeze some params"
    )
  if isinstance(schedule, Mapping) or hasattr(schedule, "to_dict"):
    return ((".*", _plain(schedule)),)
  try:
    return tuple((regex, None if s is None else _plain(s)) for regex, s in schedule)
  except (TypeError, ValueError):
    raise OptimizerError(
        "config.schedule must be a dict or a list of (regex, dict | None) pairs, "
        f"got {schedule!r}"
    ) from None


def _schedule(config, schedule: dict) -> Callable:
  try:
    return make_schedule(
        1.0,
        config.total_steps,
        batch_size=config.get("batch_size"),
        data_size=config.get("data_size"),
        **schedule,
    )
  except OptimizerError as e:
    raise OptimizerError(str(e)) from None


def _pairs(config, key: str, default) -> tuple:
  value = config.get(key)
  return tuple(value) if value else tuple(default)


def _nth(pairs: Sequence, i: int, cover: bool = False) -> Callable:
  """Mask of the leaves whose first matching regex among ``pairs`` is entry ``i``."""
  return _mask([regex for regex, _ in pairs], lambda matches: matches[i], cover)


def _mask(patterns: Sequence[str], pick: Callable, cover: bool = False) -> Callable:
  """``params -> bool tree``: ``pick`` sees, per leaf, which pattern matched first.

  With ``cover`` (``config.schedule``'s patterns) every param must match one.
  """
  compiled = [re.compile(p) for p in patterns]

  def mask(params):
    named, treedef = flatten_with_names(params)
    flags = []
    for name, _ in named:
      first = next((i for i, c in enumerate(compiled) if c.fullmatch(name)), None)
      if first is None and cover:
        raise OptimizerError(
            f"param {name!r} matches no regex of config.schedule {list(patterns)}; every "
            "param must be covered: add a '.*' entry, or (regex, None) to freeze it"
        )
      flags.append(pick([i == first for i in range(len(compiled))]))
    return jax.tree.unflatten(treedef, flags)

  return mask


def _plain(value) -> dict:
  return dict(value.to_dict() if hasattr(value, "to_dict") else value)
