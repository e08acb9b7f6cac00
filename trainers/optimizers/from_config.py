"""The optimizer section of a config, read as big_vision reads it, next to the project's names.

``config.optax_name`` is either a name of this project's registry (``adamw``,
``kron``, ``shampoo``, ``muon``, ...: :func:`make_optimizer`, which takes the
learning rate and ``config.wd`` itself) or any name big_vision's ``optax.make`` takes
(an optax attribute, dotted or not: ``"scale_by_adam"``, ``"adafactor"`` when written
``"optax.adafactor"``, ``"contrib.scale_by_muon"``; big_vision's own
``"big_vision.momentum_hp"``, ...), built as big_vision builds it
(:mod:`bv_sharding.big_vision.optax`, whose docstring draws the chain): ``config.wd``
decoupled, the schedules per ``(regex, schedule)`` entry, a ``None`` schedule freezing
the leaves it takes.

Either way the optimizer's floating-point state is stored in ``config.state_dtype``
(default: ``config.param_dtype``) and updated in float32
(:func:`~bv_sharding.optimizers.state_dtype.with_state_dtype`); a dtype argument in
``config.optax`` (``mu_dtype``, Kron's ``precond_dtype``) wins for what it names. The chain
ends with a ramp (:func:`~bv_sharding.optimizers.rebirth.ramped`: one scalar of state) that
ramps in, over ``config.rewarmup_steps``, a state born mid-run by a resume.

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

from collections.abc import Callable

import optax

from bv_sharding.big_vision import ConfigError
from bv_sharding.big_vision import optax as bv_optax
from bv_sharding.big_vision.schedules import make_schedule
from bv_sharding.big_vision.transformations import TRANSFORMATIONS, factory, transformation
from bv_sharding.optimizers import ramped, with_state_dtype
from trainers import precision
from trainers.errors import OptimizerError, closest
from trainers.optimizers import registry
from trainers.settings import schema


def from_config(config, layout=None) -> tuple[optax.GradientTransformation, dict[str, Callable]]:
  """``(tx, learning_rates)`` from ``config.optax_name``, ``optax``, ``lr``, ``wd``,
  ``schedule``, ``grad_clip_norm`` (and big_vision's ``lr_mults``/``wd_mults``).

  ``learning_rates`` maps ``"lr"`` (and ``"lr1"``, ``"lr2"``, ... for further
  ``(regex, schedule)`` entries) to ``step -> learning rate``: the very
  schedules the optimizer applies, for logging (a registry optimizer's ``lr_scale``
  included). ``layout``: the params' :class:`~bv_sharding.optimizers.layout.ParamLayout`, for
  the project's optimizers that follow the params' layout: Kron and Shampoo fit each of a
  param's fixed tiles where its shards are (or cut shard-local blocks with
  ``blocking="local"``), Muon orthogonalises each matrix on an owner device.
  The state is stored in ``config.state_dtype`` (see the module docstring).
  """
  config = schema.of(config)
  name = config.optax_name
  try:
    kwargs = bv_optax.optax_kwargs(config.source)  # big_vision's reading of its section.
    entries = bv_optax.schedule_entries(config.source)
    schedules = [None if sched is None else _schedule(config, sched) for _, sched in entries]
  except ConfigError as e:
    raise OptimizerError(str(e)) from None
  peak = config.lr * (registry.lr_scale(name) if name in registry.OPTIMIZERS else 1.0)
  learning_rates = {
      f"lr{i or ''}": (lambda step, s=s: peak * s(step))
      for i, s in enumerate(s for s in schedules if s is not None)
  }
  if name in registry.OPTIMIZERS:
    tx = _registry_optimizer(config, name, kwargs, entries, schedules, layout)
  else:
    tx = _big_vision_chain(config, name, kwargs, schedules, layout)
  tx = with_state_dtype(tx, precision.of_config(config).state)
  # Ramps in an optimizer state born mid-run (rebirth.py); a fresh run's updates as they are.
  return ramped(tx, config.rewarmup_steps), learning_rates


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
        weight_decay=config.wd or 0.0,
        clip_norm=config.grad_clip_norm,
        layout=layout,
        **kwargs,
    )
  except OptimizerError as e:
    raise OptimizerError(f"config.optax_name / config.optax: {e}") from None


def _big_vision_chain(
    config, name: str, kwargs: dict, schedules, layout
) -> optax.GradientTransformation:
  try:
    factory(name)
  except ConfigError:
    known = [*registry.OPTIMIZERS, *TRANSFORMATIONS, *dir(optax)]
    raise OptimizerError(
        f"config.optax_name={name!r} is neither one of the project's optimizers "
        f"({', '.join(registry.OPTIMIZERS)}) nor an optax attribute (e.g. 'scale_by_adam') nor "
        f"one of the library's transformations ({', '.join(TRANSFORMATIONS)})"
        f"{closest(name.removeprefix('optax.'), known)}"
    ) from None
  try:
    return bv_optax.chain(config.source, transformation(name, kwargs, layout), schedules)
  except ConfigError as e:
    raise OptimizerError(str(e)) from None


def _schedule(config, schedule: dict) -> Callable:
  return make_schedule(
      1.0,
      config.total_steps,
      batch_size=config.batch_size,
      data_size=config.data_size,
      **schedule,
  )
