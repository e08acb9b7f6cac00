"""Checks of every config value the trainer reads, before anything is written or allocated.

``check_config`` runs right after the flags are parsed (before jax's backend starts or the
workdir is touched): each key's check as ``trainers/settings/schema.py`` declares it with
the key (:func:`check_key`: counts >= 1, seeds >= 0, a positive finite learning rate, a
positive clip norm or None, distinct data axes, well-formed strategy and rule lists), then
those across keys or inside one (the schedule's durations >= 0, the microbatches dividing
the batch, the profiled steps within the run), and >= 1 processes and devices. The input's own checks
(``trainers/input/sources.py``) cover what needs the data (seq_len against the files), and
``check_memory`` compares the plan's bytes per device with the devices' memory before init.
Each failure is one ``ConfigError`` naming ``config.<key>`` (or the flag) and a valid value.

Example:
  >>> import configs.lm
  >>> config = configs.lm.get_config()
  >>> check_config(config)
  >>> config.lr = -1.0
  >>> check_config(config)
  Traceback (most recent call last):
  ...
  bv_sharding.errors.ConfigError: config.lr=-1.0: must be a finite number > 0, e.g. --config.lr=0.003
"""

import math
from collections.abc import Mapping, Sequence

import ml_collections

from bv_sharding import big_vision
from bv_sharding.big_vision import schedules
from trainers import precision
from trainers.errors import ConfigError, closest
from trainers.figures import memory
from trainers.settings import schema

LARGEST_LEAVES = 5


def check_config(config, *, devices_per_process=1, num_processes=1, process_id=0) -> None:
  """Raises ``ConfigError`` for the first config value or process flag the trainer cannot use.

  Example: ``check_config(config, devices_per_process=8)`` returns None for configs/lm.py.
  """
  check_count("--devices_per_process", devices_per_process, example=8)
  check_count("--num_processes", num_processes, example=1)
  if not _is_int(process_id) or not 0 <= process_id < num_processes:
    raise ConfigError(
        f"--process_id={process_id!r}: must be an integer in [0, {num_processes}) "
        f"for --num_processes={num_processes}, e.g. --process_id=0"
    )
  config = schema.of(config)
  for name, f in schema.keys().items():
    if f.metadata["check"] and (schema.sets(config, name) or not f.metadata.get("optional")):
      check_key(f"config.{name}", getattr(config, name), f.metadata["check"])
  _check_schedule(config.schedule)
  _check_optax_dtypes(config.optax)
  _check_accumulation(config)
  _check_profile_steps(config.profile_steps, config.total_steps)


def check_key(key: str, value, check) -> None:
  """Raises unless ``value`` passes ``check``, a key's check as the schema declares it
  (trainers/settings/schema.py: ``Int``, ``Number``, ``Choice``, ``Pairs``, ``Names``, ``Dict``).

  Example: ``check_key("config.log_every", 0, schema.Int(20))`` raises naming config.log_every.
  """
  if getattr(check, "none_ok", False) and value is None:
    return
  match check:
    case schema.Int(example, minimum):
      check_int(key, value, minimum=minimum, example=example)
    case schema.Number(example, positive, none_ok):
      check_number(key, value, positive=positive, example=example, none_ok=none_ok)
    case schema.Choice(choices):
      _check_choice(key, value, choices)
    case schema.Pairs(example, none_ok, text_ok):
      if not (text_ok and isinstance(value, str)):
        _check_pairs(key, value or () if none_ok else value, example)
    case schema.Names():
      _check_names(key, value)
    case schema.Dict(what, example):
      if not _is_dict(value):
        raise ConfigError(f"{key}={value!r}: must be a dict of {what}, e.g. {example}")


def check_count(key: str, value, example: int) -> None:
  """Raises unless ``value`` is an integer >= 1.

  Example: ``check_count("config.log_every", 0, example=20)`` raises naming config.log_every.
  """
  check_int(key, value, minimum=1, example=example)


def check_int(key: str, value, minimum: int, example: int) -> None:
  """Raises unless ``value`` is an integer (not a bool) >= ``minimum``.

  Example: ``check_int("config.seed", -1, minimum=0, example=0)`` raises.
  """
  if not _is_int(value) or value < minimum:
    raise ConfigError(
        f"{key}={value!r}: must be an integer >= {minimum}, e.g. {_flag(key)}={example}"
    )


def check_number(key: str, value, positive: bool, example: float, none_ok: bool = False) -> None:
  """Raises unless ``value`` is a finite number, > 0 if ``positive`` else >= 0.

  Example: ``check_number("config.lr", float("nan"), positive=True, example=3e-3)`` raises.
  """
  ok = (
      isinstance(value, (int, float))
      and not isinstance(value, bool)
      and math.isfinite(value)
      and (value > 0 if positive else value >= 0)
  )
  if not ok:
    bound = "> 0" if positive else ">= 0"
    also = " (or None to turn it off)" if none_ok else ""
    raise ConfigError(
        f"{key}={value!r}: must be a finite number {bound}{also}, e.g. {_flag(key)}={example}"
    )


def check_memory(
    plan, devices: Sequence, host_available: int | None = None, memory_gib: float | None = None
) -> str:
  """Raises if the plan's state and gradients do not fit the devices' memory; else says what fit.

  Per device the step holds the planned params and optimizer state plus gradients (the
  params' bytes again). Each device's memory is ``memory_gib`` (``config.device_memory_gib``)
  when given, else jax's ``bytes_limit`` of each accelerator; CPU devices share the host, so
  their bytes together are compared with the host's available memory (``host_available``,
  default from /proc/meminfo): :func:`trainers.figures.memory.budget`. The compiled step's own
  figure (activations too) is checked next, by :func:`trainers.figures.memory.check_step`.

  Example: ``check_memory(plan, jax.local_devices())`` raises for configs/lm_7b_pod.py on 8
  CPU devices.
  """
  grads = sum(e.bytes_per_device for e in plan.entries if e.name.split("/")[0] == "params")
  grads = grads or plan.bytes_per_device  # A tree without "params" is all params.
  have = memory.budget(devices, memory_gib, host_available)
  if have.total is None:
    return f"{have.where}: memory check skipped"
  need = (plan.bytes_per_device + grads) * have.shared_by
  if need > have.total:
    raise ConfigError(_too_big(plan, need, have.total, have.where))
  return f"memory: {memory.size(need)} planned of {memory.size(have.total)} ({have.where})"


def _too_big(plan, need: int, have: int, where: str) -> str:
  largest = sorted(plan.entries, key=lambda e: -e.bytes_per_device)[:LARGEST_LEAVES]
  leaves = ", ".join(f"{e.name} {memory.size(e.bytes_per_device)}" for e in largest)
  return (
      f"config.model / config.mesh / config.sharding_strategy: the plan needs "
      f"{memory.size(need)} (params + optimizer state {memory.size(plan.bytes_per_device)} "
      f"per device, plus gradients) but {where} is {memory.size(have)}; "
      f"largest leaves per device: {leaves}. Use a smaller config.model, more devices, "
      "or shard more (e.g. fsdp over more axes)"
  )


def _check_optax_dtypes(optax_kwargs) -> None:
  """The ``*_dtype`` keys of ``config.optax`` name dtypes of ``precision.DTYPES`` (the
  config's own dtype keys are checked as the schema declares)."""
  if _is_dict(optax_kwargs):
    for key, value in optax_kwargs.items():
      if key.endswith("dtype") and value is not None:
        _check_choice(f"config.optax.{key}", value, precision.DTYPES)


def _check_accumulation(config) -> None:
  """``config.grad_accum_steps`` (a count, checked before) divides ``config.batch_size``."""
  steps, batch = config.grad_accum_steps, config.batch_size
  if _is_int(batch) and batch % steps:
    raise ConfigError(
        f"config.grad_accum_steps={steps}: must divide config.batch_size={batch} into equal "
        f"microbatches, e.g. --config.grad_accum_steps={_divisor(batch, steps)}"
    )


def _check_profile_steps(steps, total_steps) -> None:
  """``config.profile_steps`` is None or two integers ``start < stop``, ``start`` at least 1
  and at most ``total_steps`` (a later start traces nothing)."""
  if steps is None:
    return
  if not (
      isinstance(steps, tuple | list)
      and len(steps) == 2
      and all(_is_int(s) for s in steps)
      and 1 <= steps[0] < steps[1]
  ):
    raise ConfigError(
        f"config.profile_steps={steps!r}: must be two integers 1 <= start < stop (steps "
        'start..stop-1 are traced), e.g. --config.profile_steps="(10, 13)", or None'
    )
  if _is_int(total_steps) and steps[0] > total_steps:
    raise ConfigError(
        f"config.profile_steps={steps!r} starts after config.total_steps={total_steps}: no step "
        f"would be traced; start at most at {total_steps}"
    )


def _divisor(n: int, limit: int) -> int:
  """The largest divisor of ``n`` not above ``limit``."""
  return max(d for d in range(1, min(n, limit) + 1) if n % d == 0)


def _check_schedule(schedule) -> None:
  """big_vision's ``config.schedule``: None, one dict, or ``(regex, dict | None)`` pairs."""
  if schedule is None:
    return
  if _is_dict(schedule):
    entries = [("config.schedule", schedule)]
  elif isinstance(schedule, (list, tuple)) and all(
      isinstance(e, (list, tuple)) and len(e) == 2 and isinstance(e[0], str) for e in schedule
  ):
    entries = [(f"config.schedule[{i}]", s) for i, (_, s) in enumerate(schedule) if s is not None]
  else:
    raise ConfigError(
        f"config.schedule={schedule!r}: must be None, a dict like "
        'dict(decay_type="cosine", warmup_steps=10), or (regex, dict or None) pairs'
    )
  for where, entry in entries:
    if not _is_dict(entry):
      raise ConfigError(f"{where}={entry!r}: must be a dict like dict(decay_type='cosine')")
    try:
      schedules.check_keys(entry)
    except big_vision.ConfigError as e:
      raise ConfigError(str(e)) from None
    _check_choice(f"{where}.decay_type", entry.get("decay_type", "stair"), schedules.DECAY_TYPES)
    for key, value in entry.items():
      if key.endswith("_steps"):
        check_int(f"{where}.{key}", value, minimum=0, example=10)
      elif key.endswith(("_percent", "_examples", "_epochs")) or key in schedules.FRACTIONS:
        check_number(f"{where}.{key}", value, positive=False, example=0.0)


def _check_choice(key: str, value, choices: Sequence[str]) -> None:
  if value not in choices:
    raise ConfigError(
        f"{key}={value!r}: must be one of {list(choices)}{closest(str(value), choices)} "
        f"e.g. {_flag(key)}={choices[0]}"
    )


def _check_names(key: str, names) -> None:
  names = (names,) if isinstance(names, str) else names
  if not isinstance(names, Sequence) or not all(isinstance(n, str) and n for n in names):
    raise ConfigError(f"{key}={names!r}: must be a tuple of mesh axis names, e.g. ('data',)")
  if len(set(names)) != len(names):
    raise ConfigError(
        f"{key}={tuple(names)!r} names an axis twice; list each mesh axis once, "
        f"e.g. {tuple(dict.fromkeys(names))!r}"
    )


def _check_pairs(key: str, pairs, example: str) -> None:
  ok = isinstance(pairs, Sequence) and not isinstance(pairs, str)
  bad = next(
      (p for p in (pairs if ok else ()) if isinstance(p, str) or not _is_pair(p)),
      None,
  )
  if not ok or bad is not None:
    entry = f" (entry {bad!r})" if ok else ""
    raise ConfigError(f"{key}={pairs!r}{entry}: must be a list of pairs, e.g. {example}")


def _is_pair(value) -> bool:
  return isinstance(value, Sequence) and len(value) == 2


def _is_dict(value) -> bool:
  return isinstance(value, (Mapping, ml_collections.ConfigDict))


def _is_int(value) -> bool:
  return isinstance(value, int) and not isinstance(value, bool)


def _flag(key: str) -> str:
  return f"--{key}" if key.startswith("config.") else key
