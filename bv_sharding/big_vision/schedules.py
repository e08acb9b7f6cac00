"""Learning-rate schedules from big_vision-style ``config.schedule`` dicts.

A schedule dict uses big_vision's keys and meaning: ``decay_type`` (``"stair"``,
the default, ``"cosine"``, ``"linear"``/``"polynomial"``, ``"rsqrt"``), a
warmup and a cooldown given in ``_steps``, ``_percent`` (of ``total_steps``),
``_examples`` or ``_epochs``, and the decay's own keys (``linear_end``/``end``,
``power``, ``timescale``, ``shift``, ``steps``, ``mults``, ``mult``,
``scale_with_batchsize``). The result is ``peak_value`` times big_vision's
multiplier: linear warmup from 0, decay over the steps after it, ``linear_end``
a fraction of the peak.

Example:
    >>> sched = make_schedule(1.0, 100, warmup_steps=10, decay_type="linear")
    >>> [round(float(sched(s)), 3) for s in (0, 5, 10, 55, 100)]
    [0.0, 0.5, 1.0, 0.5, 0.0]
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import optax

from bv_sharding.errors import ConfigError, closest

__all__ = ["DECAY_TYPES", "FRACTIONS", "KEYS", "check_keys", "make_schedule"]

DECAY_TYPES = ("stair", "cosine", "linear", "polynomial", "rsqrt")
_DURATIONS = ("warmup", "cooldown", "timescale", "shift")
_UNITS = ("steps", "percent", "examples", "epochs")
KEYS = (
    "decay_type",
    "linear_end",
    "end",
    "power",
    "steps",
    "mults",
    "mult",
    "scale_with_batchsize",
    *(f"{d}_{u}" for d in _DURATIONS for u in _UNITS),
    "timescale",
    "shift",
)
FRACTIONS = ("linear_end", "end", "mult")  # Multipliers of the peak: finite, >= 0.
RENAMED = {  # the project's old spelling -> what to write now
    "decay": "decay_type (big_vision's spelling), e.g. decay_type='cosine'",
    "end_value": (
        "linear_end with decay_type='linear': the end as a fraction of config.lr "
        "(end_value / lr); big_vision's cosine decays to 0"
    ),
}


def make_schedule(
    peak_value: float,
    total_steps: int,
    *,
    batch_size: int | None = None,
    data_size: int | None = None,
    **schedule,
) -> optax.Schedule:
  """``peak_value`` times big_vision's schedule multiplier for ``config.schedule`` keys.

  ``batch_size``/``data_size`` convert ``_examples``/``_epochs`` durations to
  steps (and scale the peak under ``scale_with_batchsize``).

  Raises:
    ConfigError: an unknown or renamed key (with the key to use), an unknown
      ``decay_type``, a duration that cannot be converted, or a warmup that
      does not end before ``total_steps``.
  """
  check_keys(schedule)
  decay_type = schedule.get("decay_type", "stair")
  if decay_type not in DECAY_TYPES:
    raise ConfigError(f"config.schedule.decay_type={decay_type!r}; expected one of {DECAY_TYPES}")
  to_steps = lambda name, default=0: _steps(
      name, schedule, total_steps, batch_size, data_size, default
  )
  warmup, cooldown = to_steps("warmup"), to_steps("cooldown")
  if total_steps > 1 and warmup >= total_steps:
    raise ConfigError(
        f"config.schedule warmup ({warmup} steps) must end before total_steps ({total_steps})"
    )
  base = schedule.get("mult", 1.0)
  if schedule.get("scale_with_batchsize"):
    base = base * _need(batch_size, "scale_with_batchsize", "batch_size") / 256.0
  decay = _decay(decay_type, base, warmup, total_steps, schedule, to_steps)

  def schedule_fn(step):
    multiplier = decay(step)
    if warmup:
      multiplier = multiplier * jnp.minimum(1.0, step / warmup)
    if cooldown:
      multiplier = multiplier * jnp.minimum(1.0, (total_steps - step) / cooldown)
    return jnp.asarray(peak_value * multiplier, jnp.float32)

  return schedule_fn


def _decay(decay_type, base, warmup, total_steps, schedule, to_steps):
  """``step -> multiplier`` before warmup and cooldown are applied."""
  progress = lambda step: jnp.clip((step - warmup) / max(total_steps - warmup, 1), 0.0, 1.0)
  if decay_type in ("linear", "polynomial"):
    end = schedule.get("end", schedule.get("linear_end", 0.0))
    power = schedule.get("power", 1)
    return lambda step: end + (base - end) * (1.0 - progress(step)) ** power
  if decay_type == "cosine":
    return lambda step: base * 0.5 * (1.0 + jnp.cos(jnp.pi * progress(step)))
  if decay_type == "rsqrt":
    timescale = to_steps("timescale", schedule.get("timescale", 10_000))
    shift = to_steps("shift", schedule.get("shift", 0))
    return lambda step: jnp.where(
        step >= warmup,
        base / jnp.sqrt(1.0 + (step + shift - warmup) / timescale),
        base / jnp.sqrt(1.0 + shift / timescale),
    )
  # Host arrays until traced: building the schedule moves nothing to a device (big_vision's
  # train.py disallows transfers).
  boundaries = np.asarray(schedule.get("steps", []), np.int32)
  factors = np.asarray([1.0, *schedule.get("mults", [])], np.float32)
  return lambda step: base * jnp.asarray(factors)[jnp.searchsorted(boundaries, step + 1)]


def _steps(prefix, schedule, total_steps, batch_size, data_size, default) -> int:
  """A duration ``prefix_{steps,percent,examples,epochs}`` in steps (at most one given)."""
  given = {
      u: schedule[f"{prefix}_{u}"] for u in _UNITS if schedule.get(f"{prefix}_{u}") is not None
  }
  given = {u: v for u, v in given.items() if v >= 0}
  if len(given) > 1:
    keys = ", ".join(f"{prefix}_{u}" for u in given)
    raise ConfigError(f"config.schedule sets {keys}; keep only one of them")
  if not given:
    return default
  ((unit, value),) = given.items()
  if unit == "steps":
    return int(value)
  if unit == "percent":
    if not 0.0 <= value <= 1.0:
      raise ConfigError(
          f"config.schedule.{prefix}_percent={value} must lie in [0, 1] (a fraction of total_steps)"
      )
    return _round(value * total_steps)
  if unit == "examples":
    return _round(value / _need(batch_size, f"{prefix}_examples", "batch_size"))
  per_epoch = _need(data_size, f"{prefix}_epochs", "the training set size") / _need(
      batch_size, f"{prefix}_epochs", "batch_size"
  )
  return _round(value * per_epoch)


def _round(x: float) -> int:
  """Nearest step count, but at least 1 unless exactly 0 (as big_vision rounds)."""
  return max(1, round(x)) if x else 0


def _need(value, key: str, what: str):
  if not value:
    raise ConfigError(
        f"config.schedule.{key} needs {what}, which was not given (sched_kw); "
        f"give the duration as {key.rsplit('_', 1)[0]}_steps or _percent"
    )
  return value


def check_keys(schedule) -> None:
  """Raises for a key big_vision's schedules do not know, or the project's old spelling of one.

  Example:
    >>> check_keys(dict(decay_type="cosine", warmup_steps=10))
  """
  for key in schedule:
    if key in RENAMED:
      raise ConfigError(f"config.schedule.{key} was renamed: use {RENAMED[key]}")
    if key not in KEYS:
      raise ConfigError(
          f"config.schedule.{key} is not a schedule key (keys: {', '.join(KEYS)})"
          f"{closest(key, KEYS)}"
      )
