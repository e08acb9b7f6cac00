"""big_vision's ``optax`` module as its ``train.py`` calls it: ``make``, ``get_count``,
``replace_frozen``, built with optax only.

:func:`make` turns a config's optimizer section into the chain big_vision builds::

    clip(grad_clip_norm) -> optax_name(**config.optax) -> scale(lr) -> lr_mults
    -> + wd * mult * param on wd_mults' leaves (default ".*/kernel$")
    -> x schedule(step) per (regex, schedule) of config.schedule -> zero frozen -> negate

so ``config.wd`` is decoupled, applied after the learning rate (not multiplied by it)
and scaled by the schedule. Regexes fullmatch ``/``-joined param names and a leaf
takes the first regex of its list that matches; a ``None`` schedule freezes the
leaves it takes, and every param must be taken by one ``config.schedule`` regex.
``config.optax_name`` is resolved by :mod:`~bv_sharding.big_vision.transformations`; the
library's optimizers there (``bv_sharding.scale_by_kron``, ``bv_sharding.scale_by_shampoo``,
``bv_sharding.scale_by_muon``) get the params' layout from ``config.mesh``,
``config.sharding_strategy`` and ``config.sharding_rules`` on ``jax.devices()``
(:mod:`~bv_sharding.big_vision.layout`), as ``train.py`` will place them.
A config is a ``ConfigDict`` or a plain dict.

Example:
  >>> import jax.numpy as jnp
  >>> params = {"dense": {"kernel": jnp.ones((2, 2)), "bias": jnp.zeros(2)}}
  >>> config = dict(optax_name="scale_by_adam", lr=0.1, wd=0.01,
  ...               schedule=dict(decay_type="cosine", warmup_steps=2))
  >>> tx, sched_fns = make(config, params, sched_kw=dict(total_steps=10))
  >>> [round(float(sched_fns[0](step)), 3) for step in (0, 1, 2, 10)]
  [0.0, 0.5, 1.0, 0.0]
  >>> state = tx.init(params)
  >>> _, state = tx.update(params, state, params)
  >>> get_count(state)
  1
"""

import operator
from collections.abc import Callable, Mapping, Sequence

import jax
import optax

from bv_sharding.big_vision.layout import layout_of
from bv_sharding.big_vision.masks import first_match
from bv_sharding.big_vision.schedules import make_schedule
from bv_sharding.big_vision.transformations import takes_layout, transformation
from bv_sharding.errors import ConfigError

__all__ = [
    "DEFAULT_WD_MULTS",
    "chain",
    "find_states",
    "get_count",
    "make",
    "optax_kwargs",
    "replace_frozen",
    "schedule_entries",
]

DEFAULT_WD_MULTS = ((".*/kernel$", 1.0),)
_RETIRED = {  # keys big_vision refuses -> what to write
    "optim": "config.optax (with config.optax_name)",
    "weight_decay": "config.wd (decoupled, scaled by config.schedule)",
}


def make(config, params, *, sched_kw: Mapping) -> tuple[optax.GradientTransformation, list]:
  """``(tx, sched_fns)`` for ``config``'s optimizer section, as big_vision's ``make``.

  Args:
    config: ``optax_name``, ``lr``, and optionally ``optax``, ``schedule``, ``wd``,
      ``wd_mults``, ``lr_mults``, ``grad_clip_norm``; for the library's optimizers also
      ``mesh``, ``sharding_strategy``, ``sharding_rules`` and ``scanned_layers``
      (:func:`~bv_sharding.big_vision.layout.layout_of`).
    params: the (unboxed) params or their shapes; the regexes are checked against them,
      and the library's optimizers are laid out on them (module docstring).
    sched_kw: ``total_steps`` and optionally ``batch_size``, ``data_size``.

  Returns:
    The chain (module docstring) and, per unfrozen ``config.schedule`` entry in order,
    ``step -> multiplier`` of ``config.lr``.

  Raises:
    ConfigError: a key big_vision retired, an unknown name or argument, a schedule key or
      value big_vision rejects, a param no ``config.schedule`` regex takes, or a
      ``config.scanned_layers`` mistake.
    ShardingError: for the library's optimizers, a ``config.mesh`` that does not fit the
      devices or a strategy mistake.
  """
  for key, instead in _RETIRED.items():
    if key in config:
      raise ConfigError(f"config.{key} was retired by big_vision; write {instead}")
  if not config.get("weight_decay_decouple", True):
    raise ConfigError(
        "config.weight_decay_decouple=False: big_vision's weight decay is decoupled only; "
        "drop the key"
    )
  entries = schedule_entries(config)
  schedules = [None if s is None else make_schedule(1.0, **sched_kw, **s) for _, s in entries]
  first_match([regex for regex, _ in entries], "config.schedule", cover=True)(params)
  name, kwargs = optax_name(config), optax_kwargs(config)
  if isinstance(kwargs.get("scanned_layers"), str):
    raise ConfigError(
        f"config.optax.scanned_layers={kwargs['scanned_layers']!r}: name the stacked params "
        "with config.scanned_layers instead (a regex of their names, read for every library "
        "optimizer)"
    )
  layout = layout_of(config, params) if takes_layout(name) else None
  tx = chain(config, transformation(name, kwargs, layout), schedules)
  return tx, [s for s in schedules if s is not None]


def chain(config, tx: optax.GradientTransformation, schedules: Sequence):
  """``tx`` inside big_vision's chain (module docstring) for ``config``'s section.

  ``schedules``: per ``config.schedule`` entry (:func:`schedule_entries`), ``step ->
  multiplier``, or ``None`` for a frozen entry. The masks are computed from the tree
  ``init`` and ``update`` see.
  """
  entries = schedule_entries(config)
  patterns = [regex for regex, _ in entries]
  frozen_flags = [s is None for s in schedules]
  frozen = first_match(patterns, "config.schedule", cover=True, pick=frozen_flags)
  trainable = _negated(frozen)
  clip = config.get("grad_clip_norm")
  lr_mults = _pairs(config, "lr_mults", ())
  if any(mult <= 0 for _, mult in lr_mults):
    raise ConfigError(
        f"config.lr_mults={list(lr_mults)}: every multiplier must be > 0; freeze params with a "
        "(regex, None) entry of config.schedule"
    )
  wd = config.get("wd") or 0.0
  wd_mults = _pairs(config, "wd_mults", DEFAULT_WD_MULTS) if wd else ()
  return optax.chain(
      optax.masked(optax.clip_by_global_norm(clip), trainable) if clip else optax.identity(),
      optax.masked(tx, trainable),
      optax.scale(_lr(config)),
      *[
          optax.masked(optax.scale(mult), _nth(lr_mults, i, "config.lr_mults"))
          for i, (_, mult) in enumerate(lr_mults)
      ],
      *[
          optax.add_decayed_weights(wd * mult, _nth(wd_mults, i, "config.wd_mults"))
          for i, (_, mult) in enumerate(wd_mults)
      ],
      *[
          optax.masked(optax.scale_by_schedule(s), _nth(entries, i, "config.schedule"))
          for i, s in enumerate(schedules)
          if s is not None
      ],
      optax.masked(optax.set_to_zero(), frozen),
      optax.scale(-1.0),
  )


def schedule_entries(config) -> tuple[tuple[str, dict | None], ...]:
  """``config.schedule`` as ``(regex, dict | None)`` pairs; a lone dict covers ``".*"``, and no
  ``schedule`` key is big_vision's default, a constant multiplier of 1.

  Example:
    >>> schedule_entries({"schedule": [("img/.*", None), (".*", {"decay_type": "cosine"})]})
    (('img/.*', None), ('.*', {'decay_type': 'cosine'}))
  """
  schedule = config.get("schedule", {})
  if schedule is None:
    raise ConfigError(
        "config.schedule is None, which would freeze every param; write "
        'dict(decay_type="stair") for a constant learning rate, or list (regex, None) pairs '
        "to freeze some params"
    )
  if isinstance(schedule, Mapping) or hasattr(schedule, "to_dict"):
    return ((".*", _plain(schedule)),)
  try:
    return tuple((regex, None if s is None else _plain(s)) for regex, s in schedule)
  except (TypeError, ValueError):
    raise ConfigError(
        f"config.schedule must be a dict or a list of (regex, dict | None) pairs, got {schedule!r}"
    ) from None


def optax_name(config) -> str:
  """``config.optax_name``, once it is a name.

  Example:
    >>> optax_name({"optax_name": "scale_by_adam"})
    'scale_by_adam'
  """
  name = config.get("optax_name")
  if not isinstance(name, str) or not name:
    raise ConfigError(
        f"config.optax_name={name!r}: name the optimizer, an optax transformation such as "
        "'scale_by_adam' or one of the library's, such as 'bv_sharding.scale_by_kron'"
    )
  return name


def optax_kwargs(config) -> dict:
  """``config.optax`` as a plain dict (``{}`` when absent).

  Example:
    >>> optax_kwargs({"optax": {"b2": 0.95}}), optax_kwargs({})
    ({'b2': 0.95}, {})
  """
  kwargs = config.get("optax") or {}
  if not isinstance(kwargs, Mapping) and not hasattr(kwargs, "to_dict"):
    raise ConfigError(
        f"config.optax={kwargs!r}: must be a dict of the optimizer's keyword arguments, e.g. "
        "dict(b2=0.95)"
    )
  return _plain(kwargs)


def find_states(opt_state, cls) -> list:
  """The nodes of ``opt_state`` that are ``cls`` instances, in tree order.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> state = optax.scale_by_schedule(lambda step: 1.0).init({"w": jnp.ones(2)})
    >>> find_states(((), state), optax.ScaleByScheduleState)
    [ScaleByScheduleState(count=Array(0, dtype=int32))]
  """
  is_state = lambda node: isinstance(node, cls)
  return [node for node in jax.tree.leaves(opt_state, is_leaf=is_state) if is_state(node)]


def get_count(opt_state, jittable: bool = False):
  """The step count of :func:`make`'s chain: its ``ScaleByScheduleState.count``.

  With ``jittable`` the first count as an array (usable under ``jax.jit``); else the one
  count all schedules share, as an ``int``.

  Raises:
    ConfigError: ``opt_state`` has no schedule state, or its schedules' counts differ.
  """
  counts = [state.count for state in find_states(opt_state, optax.ScaleByScheduleState)]
  if not counts:
    raise ConfigError(
        "opt_state holds no optax.ScaleByScheduleState; build the optimizer with make(config, "
        "params, sched_kw=...), whose chain counts steps"
    )
  if jittable:
    return counts[0]
  distinct = {int(c) for c in counts}
  if len(distinct) != 1:
    raise ConfigError(f"opt_state's schedules count different steps {sorted(distinct)}")
  return distinct.pop()


def replace_frozen(schedule, pytree, replacement, log=None):
  """``pytree`` with ``replacement`` on the leaves a ``(regex, None)`` entry of ``schedule``
  freezes; a ``schedule`` that is not a list (one dict) freezes nothing. ``log`` (big_vision
  logs the matches there) is accepted and unused.

  Example:
    >>> replace_frozen([("img/.*", None), (".*", {})], {"img": {"w": 1.0}, "txt": {"w": 2.0}}, 0.0)
    {'img': {'w': 0.0}, 'txt': {'w': 2.0}}
  """
  del log
  if not isinstance(schedule, (list, tuple)):
    return pytree
  entries = schedule_entries({"schedule": schedule})
  flags = [s is None for _, s in entries]
  frozen = first_match([r for r, _ in entries], "config.schedule", cover=True, pick=flags)
  return jax.tree.map(lambda v, f: replacement if f else v, pytree, frozen(pytree))


def _lr(config) -> float:
  if config.get("lr") is None:
    raise ConfigError("config.lr is missing: the peak learning rate, e.g. config.lr = 1e-3")
  return config["lr"]


def _pairs(config, key: str, default) -> tuple:
  value = config.get(key)
  return tuple(tuple(pair) for pair in value) if value else tuple(default)


def _nth(pairs: Sequence, i: int, where: str) -> Callable:
  """Mask of the leaves whose first matching regex among ``pairs`` is entry ``i``."""
  flags = [j == i for j in range(len(pairs))]
  return first_match([regex for regex, _ in pairs], where, cover=False, pick=flags)


def _negated(mask: Callable) -> Callable:
  return lambda tree: jax.tree.map(operator.not_, mask(tree))


def _plain(value) -> dict:
  return dict(value.to_dict() if hasattr(value, "to_dict") else value)
