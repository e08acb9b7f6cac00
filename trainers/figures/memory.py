"""Whether the compiled train step fits each device: XLA's figures, before anything is allocated.

The plan counts params, optimizer state and gradients; the step also holds its batch,
activations and XLA's temporaries. :func:`steps.compile_train_step` compiles the step from
abstract inputs in the planned shardings, and XLA's ``memory_analysis()`` of that executable
(:class:`StepMemory`: arguments + temporaries + outputs - aliased, per device) is compared
with what each device may use (:func:`budget`: ``config.device_memory_gib`` when set, else
jax's ``bytes_limit`` of each accelerator, else, on CPU, the host's available memory shared
by its devices). :func:`check_step` says what fit, or raises one ``ConfigError`` naming the
figures, the largest contributors and what would fit (more microbatches, remat, more
devices). The trainer runs it right after the plan's own check; ``python -m trainers.plan
--compile`` prints the same figures.

Example:
  >>> step = StepMemory(arguments=3 * GiB, temporaries=8 * GiB, outputs=3 * GiB, aliased=3 * GiB)
  >>> step.total / GiB
  11.0
  >>> Budget(total=16 * GiB, shared_by=2, where="the host").per_device / GiB
  8.0
"""

import dataclasses
import math
import os
from collections.abc import Sequence

import flax.linen as nn
import jax

from trainers import MiB, steps
from trainers.errors import ConfigError

GiB = 2**30
LARGEST_LEAVES = 3  # Leaves named among the arguments of a step that does not fit.


@dataclasses.dataclass(frozen=True)
class StepMemory:
  """A compiled step's bytes per device, from XLA's ``memory_analysis()``.

  ``arguments``: the inputs (params, optimizer state, the batch); ``temporaries``:
  activations, gradients and XLA's buffers; ``outputs``: the new state and the metrics;
  ``aliased``: the outputs written over donated arguments (counted once).
  """

  arguments: int
  temporaries: int
  outputs: int
  aliased: int

  @property
  def total(self) -> int:
    """The step's peak bytes per device: arguments + temporaries + outputs - aliased."""
    return self.arguments + self.temporaries + self.outputs - self.aliased

  @classmethod
  def of(cls, compiled) -> "StepMemory | None":
    """The figures of a compiled executable; None when its backend gives none."""
    stats = compiled.memory_analysis()
    if stats is None:
      return None
    return cls(
        arguments=stats.argument_size_in_bytes,
        temporaries=stats.temp_size_in_bytes,
        outputs=stats.output_size_in_bytes,
        aliased=stats.alias_size_in_bytes,
    )

  def as_dict(self) -> dict:
    """The figures and their total, in bytes (the planning command's JSON)."""
    return {**dataclasses.asdict(self), "total": self.total}


@dataclasses.dataclass(frozen=True)
class Budget:
  """What the devices may use: ``total`` bytes (None: unknown) shared by ``shared_by`` devices.

  CPU devices share the host (``shared_by`` of them); an accelerator has its own
  (``shared_by`` 1). ``where`` names the figure in messages.
  """

  total: int | None
  shared_by: int
  where: str

  @property
  def per_device(self) -> int | None:
    return None if self.total is None else self.total // self.shared_by


def budget(devices: Sequence, memory_gib: float | None = None, host_available=None) -> Budget:
  """Each device's memory: ``memory_gib`` (``config.device_memory_gib``) when given, else the
  smallest ``bytes_limit`` of the accelerators, else the host's available memory (CPU;
  ``host_available``, default from /proc/meminfo) shared by the CPU devices.

  Example: ``budget(jax.local_devices(), config.device_memory_gib)``.
  """
  if memory_gib is not None:
    return Budget(round(memory_gib * GiB), 1, f"config.device_memory_gib={memory_gib}")
  cpus = [d for d in devices if d.platform == "cpu"]
  if cpus:
    have = host_memory() if host_available is None else host_available
    return Budget(have, len(cpus), f"the host's available memory ({len(cpus)} CPU devices)")
  limits = [(d.memory_stats() or {}).get("bytes_limit") for d in devices]
  if not limits or None in limits:
    return Budget(None, 1, "device memory unknown (set config.device_memory_gib)")
  return Budget(min(limits), 1, f"the smallest device limit ({devices[0].device_kind})")


def host_memory() -> int:
  """The host's available memory in bytes (/proc/meminfo's MemAvailable, else sysconf)."""
  try:
    with open("/proc/meminfo") as f:
      fields = dict(line.split(":", 1) for line in f)
    return int(fields["MemAvailable"].split()[0]) * 1024
  except (OSError, KeyError, ValueError):
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def compile_step(config, plan, train_step, batch_sharding, batch_shapes) -> tuple:
  """``(compiled, StepMemory or None)``: :func:`steps.compile_train_step` under the plan's mesh
  and ``config.sharding_rules`` (as the loop runs it), and the executable's figures.

  Example: ``compiled, step = compile_step(config, plan, train_step, batch_sharding, shapes)``.
  """
  with jax.set_mesh(plan.mesh), nn.logical_axis_rules(config.sharding_rules):
    compiled = steps.compile_train_step(train_step, plan, batch_sharding, batch_shapes)
  return compiled, StepMemory.of(compiled)


def report(step: StepMemory | None, have: Budget) -> dict:
  """The figures as plain data (``trainers.plan --compile``'s JSON): bytes per device.

  Example:
    >>> report(StepMemory(4, 10, 4, 4), Budget(None, 1, "unknown"))["fits"] is None
    True
  """
  figures = None if step is None else step.as_dict()
  fits = None if step is None or have.per_device is None else step.total <= have.per_device
  return {
      "per_device": figures,
      "device_memory": have.per_device,
      "where": have.where,
      "fits": fits,
  }


def check_step(step: StepMemory | None, have: Budget, plan, config, batch_sharding) -> str:
  """Raises ``ConfigError`` if the compiled step does not fit each device; else says what fit.

  ``plan``: the run's plan (its largest leaves are named); ``batch_sharding``: the batch's
  (the microbatch counts suggested split each device's rows).

  Example:
    >>> import configs.lm
    >>> config = configs.lm.get_config()
    >>> step = StepMemory(arguments=GiB, temporaries=12 * GiB, outputs=GiB, aliased=GiB)
    >>> check_step(step, Budget(16 * GiB, 1, "16 GiB"), None, config, None)
    'compiled train step: 13.00 GiB per device of 16.00 GiB (16 GiB): arguments 1.00 GiB, ...'
  """
  if step is None:
    return "compiled train step: the backend gives no memory figures; check skipped"
  figures = (
      f"arguments {size(step.arguments)}, temporaries {size(step.temporaries)}, "
      f"outputs {size(step.outputs)}, aliased {size(step.aliased)}"
  )
  if have.per_device is None:
    return f"compiled train step: {size(step.total)} per device ({figures}); {have.where}"
  fits = f"{size(have.per_device)} ({have.where})"
  if step.total <= have.per_device:
    return f"compiled train step: {size(step.total)} per device of {fits}: {figures}"
  rows = batch_sharding.shard_shape((config.batch_size,))[0]
  raise ConfigError(_too_big(step, have, plan, config, rows))


def _too_big(step: StepMemory, have: Budget, plan, config, rows: int) -> str:
  largest = sorted(plan.entries, key=lambda e: -e.bytes_per_device)[:LARGEST_LEAVES]
  leaves = ", ".join(f"{e.name} {size(e.bytes_per_device)}" for e in largest)
  parts = [
      (
          step.temporaries,
          f"temporaries {size(step.temporaries)} (activations, gradients, XLA's buffers)",
      ),
      (
          step.arguments,
          f"arguments {size(step.arguments)} (params, optimizer state and batch; "
          f"largest leaves {leaves})",
      ),
      (
          step.outputs,
          f"outputs {size(step.outputs)} ({size(step.aliased)} of them written over the "
          "donated arguments)",
      ),
  ]
  contributors = "; ".join(text for _, text in sorted(parts, key=lambda p: -p[0]))
  return (
      f"config.batch_size / config.grad_accum_steps / config.model / config.mesh: the compiled "
      f"train step needs {size(step.total)} per device but {have.where} gives "
      f"{size(have.per_device)} per device; {contributors}. Would fit: "
      + ", or ".join(suggestions(step, have.per_device, plan, config, rows))
  )


def suggestions(step: StepMemory, have: int, plan, config, rows: int) -> list[str]:
  """What would make the step fit ``have`` bytes per device, best guess first.

  More microbatches when the activations, taken as the temporaries beyond the gradients
  (the params' bytes) and shrinking with the microbatch, would then fit beside the rest;
  rematerialisation when the model has it off; always more devices.

  Example:
    >>> import configs.lm
    >>> step = StepMemory(arguments=GiB, temporaries=12 * GiB, outputs=GiB, aliased=GiB)
    >>> suggestions(step, 8 * GiB, None, configs.lm.get_config(), rows=8)[:2]
    ['--config.grad_accum_steps=2 (about 6.00 GiB of activations a microbatch)', ...]
  """
  found = []
  count = config.grad_accum_steps
  grads = 0 if plan is None else _params_bytes(plan)
  activations = max(step.temporaries - grads, 0)
  room = have - (step.total - activations)
  if room > 0 and activations:
    least = math.ceil(count * activations / room)
    more = [n for n in range(max(least, count + 1), rows + 1) if rows % n == 0]
    if more:
      found.append(
          f"--config.grad_accum_steps={more[0]} (about "
          f"{size(count * activations // more[0])} of activations a microbatch)"
      )
  model = config.model or {}
  if "remat" in model and not model["remat"]:
    found.append("--config.model.remat=True (recompute activations in the backward pass)")
  found.append(
      "more devices on a config.mesh axis (params, state and batch split further), "
      "or a smaller config.batch_size"
  )
  return found


def size(nbytes: int) -> str:
  """Bytes in words: GiB from 1 GiB up, MiB from 1 MiB up, else KiB.

  Example:
    >>> size(3 * GiB // 2), size(5 * MiB), size(1536)
    ('1.50 GiB', '5.0 MiB', '1.5 KiB')
  """
  if nbytes >= GiB:
    return f"{nbytes / GiB:.2f} GiB"
  return f"{nbytes / MiB:.1f} MiB" if nbytes >= MiB else f"{nbytes / 2**10:.1f} KiB"


def _params_bytes(plan) -> int:
  return sum(e.bytes_per_device for e in plan.entries if e.name.split("/")[0] == "params")
