"""Whether the compiled train step fits each device: XLA's figures, before anything is allocated.

The plan counts params, optimizer state and gradients; the step also holds its batch,
activations and XLA's temporaries. :func:`steps.compile_train_step` compiles the step from
abstract inputs in the planned shardings, and XLA's ``memory_analysis()`` of that executable
(:class:`StepMemory`: arguments + temporaries + outputs - aliased, per device) is compared
with what each device may use (:func:`budget`: ``config.device_memory_gib`` when set, else
jax's ``bytes_limit`` of each accelerator, else, on CPU, the host's available memory shared
by its devices). :func:`fits` says whether it does; :func:`too_big` names the figures and the
largest contributors, and :func:`candidates` what may make it fit (more microbatches, remat,
bfloat16 state or params, more devices), which ``trainers/fit.py`` compiles to check.

XLA's own ``RESOURCE_EXHAUSTED`` (a compile it refuses on an accelerator, an allocation that
fails at run time) becomes the same one-line ``ConfigError`` (:func:`out_of_memory`), with the figures XLA gives
(:func:`converted`): wherever a step is compiled (:func:`compile_step`, which the trainer,
``python -m trainers.plan --compile`` and the benchmarks call) and around the trainer's
restore, first steps and evals.

Example:
  >>> step = StepMemory(arguments=3 * GiB, temporaries=8 * GiB, outputs=3 * GiB, aliased=3 * GiB)
  >>> step.total / GiB
  11.0
  >>> Budget(total=16 * GiB, shared_by=2, where="the host").per_device / GiB
  8.0
"""

import contextlib
import dataclasses
import math
import os
import re
from collections.abc import Sequence

import flax.linen as nn
import jax

from trainers import MiB, precision, steps
from trainers.errors import ConfigError

GiB = 2**30
LARGEST_LEAVES = 3  # Leaves named among the arguments of a step that does not fit.
CANDIDATES = 3  # Changes compiled to check what would fit (trainers/fit.py).


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

  Raises :func:`out_of_memory`'s ``ConfigError`` where XLA refuses to compile a step that does not fit.

  Example: ``compiled, step = compile_step(config, plan, train_step, batch_sharding, shapes)``.
  """
  with converted(plan, "compiling the train step"):
    with jax.set_mesh(plan.mesh), nn.logical_axis_rules(config.sharding_rules):
      compiled = steps.compile_train_step(train_step, plan, batch_sharding, batch_shapes)
  return compiled, StepMemory.of(compiled)


def out_of_memory(message: str, step: "StepMemory | None") -> ConfigError:
  """The ``ConfigError`` of a step that does not fit its devices, ``step`` its figures (from
  XLA's ``memory_analysis()``, or from XLA's message and the plan where XLA refused to compile
  it; None where unknown), kept as the error's ``step`` for :func:`candidates`.

  Example:
    >>> out_of_memory("too big", None).step is None
    True
  """
  error = ConfigError(message)
  error.step = step
  return error


def is_out_of_memory(error: BaseException) -> bool:
  """Whether ``error`` is XLA's ``RESOURCE_EXHAUSTED`` (at compile or at run time).

  Example:
    >>> is_out_of_memory(RuntimeError("RESOURCE_EXHAUSTED: Ran out of memory on HBM"))
    False
  """
  return isinstance(error, jax.errors.JaxRuntimeError) and "RESOURCE_EXHAUSTED" in str(error)


def xla_bytes(message: str, label: str) -> int | None:
  """The bytes XLA's ``message`` gives in parentheses after ``label``, e.g. "78.75G"; else None.

  Example:
    >>> text = "the total memory required for HLO temporaries (78.75G) exceeds available HBM (15.75G)."
    >>> xla_bytes(text, "HLO temporaries") / GiB, xla_bytes(text, "available HBM") / GiB
    (78.75, 15.75)
  """
  found = re.search(re.escape(label) + r" \(([\d.]+)([KMGT]?)\)", message)
  if not found:
    return None
  return round(float(found[1]) * 1024 ** " KMGT".index(found[2] or " "))


@contextlib.contextmanager
def converted(plan, doing: str):
  """XLA's ``RESOURCE_EXHAUSTED`` raised inside the block becomes one ``ConfigError`` line
  (:func:`out_of_memory`): what was being done, the figures XLA gives, the plan's bytes and largest leaves.

  Example: ``with converted(plan, "the first step"): state = step(state, batch)``.
  """
  try:
    yield
  except jax.errors.JaxRuntimeError as e:
    if not is_out_of_memory(e):
      raise
    raise xla_out_of_memory(str(e), plan, doing) from None


def xla_out_of_memory(message: str, plan, doing: str) -> ConfigError:
  """The :func:`out_of_memory` error of XLA's ``message`` (see :func:`converted`), its figures those
  XLA names (a compile's HLO temporaries beside the plan's arguments) where it names them."""
  first = " ".join(message.split())
  temporaries = xla_bytes(message, "HLO temporaries")
  arguments = _plan_bytes(plan)
  step = None
  if temporaries is not None:
    step = StepMemory(arguments, temporaries, arguments, arguments)
  leaves = largest_leaves(plan)
  return out_of_memory(
      f"config.batch_size / config.grad_accum_steps / config.model / config.mesh: {doing} ran "
      f"out of device memory (XLA: {first[:300]}); the plan holds {size(arguments)} per device "
      f"of params and optimizer state{leaves}",
      step,
  )


def largest_leaves(plan) -> str:
  """``"; largest leaves a 3.00 GiB, b 1.00 GiB"`` of ``plan`` (``""`` without one)."""
  if plan is None:
    return ""
  largest = sorted(plan.entries, key=lambda e: -e.bytes_per_device)[:LARGEST_LEAVES]
  return "; largest leaves " + ", ".join(f"{e.name} {size(e.bytes_per_device)}" for e in largest)


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


def fits(step: StepMemory | None, have: Budget) -> bool:
  """Whether ``step`` fits each device (True where either figure is unknown).

  Example:
    >>> fits(StepMemory(GiB, 12 * GiB, GiB, GiB), Budget(12 * GiB, 1, "12 GiB"))
    False
  """
  return step is None or have.per_device is None or step.total <= have.per_device


def fitted(step: StepMemory | None, have: Budget) -> str:
  """What fit: the step's figures per device against the budget.

  Example:
    >>> fitted(StepMemory(GiB, 12 * GiB, GiB, GiB), Budget(16 * GiB, 1, "16 GiB"))
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
  return f"compiled train step: {size(step.total)} per device of {size(have.per_device)} ({have.where}): {figures}"


def too_big(step: StepMemory, have: Budget, plan) -> ConfigError:
  """The :func:`out_of_memory` error of a compiled step over the budget: its figures, the largest first.

  Example:
    >>> str(too_big(StepMemory(GiB, 12 * GiB, GiB, GiB), Budget(8 * GiB, 1, "B"), None))[:87]
    'config.batch_size / config.grad_accum_steps / config.model / config.mesh: the compiled '
  """
  parts = [
      (
          step.temporaries,
          f"temporaries {size(step.temporaries)} (activations, gradients, XLA's buffers)",
      ),
      (
          step.arguments,
          f"arguments {size(step.arguments)} (params, optimizer state and batch{largest_leaves(plan)})",
      ),
      (
          step.outputs,
          f"outputs {size(step.outputs)} ({size(step.aliased)} of them written over the "
          "donated arguments)",
      ),
  ]
  contributors = "; ".join(text for _, text in sorted(parts, key=lambda p: -p[0]))
  return out_of_memory(
      f"config.batch_size / config.grad_accum_steps / config.model / config.mesh: the compiled "
      f"train step needs {size(step.total)} per device but {have.where} gives "
      f"{size(have.per_device)} per device; {contributors}",
      step,
  )


@dataclasses.dataclass(frozen=True)
class Candidate:
  """A change that may make a step fit: ``flag`` as typed, ``why``, and the config keys it
  sets (dotted, e.g. ``{"model.remat": True}``; None: it cannot be checked on this host)."""

  flag: str
  why: str
  overrides: dict | None


def candidates(step: StepMemory, have: int, plan, config, rows: int) -> list[Candidate]:
  """What may make the step fit ``have`` bytes per device, best guess first, at most
  ``CANDIDATES`` of them: more microbatches, rematerialisation, bfloat16 state or params, then
  more microbatches again; last, more devices (which no host can check for another).

  The first microbatch count is the least with which the activations, taken as the
  temporaries beyond the gradients (the params' bytes) and shrinking with the microbatch, would
  fit beside the rest; the later ones are the next counts that divide each device's ``rows``.

  Example:
    >>> import configs.lm
    >>> step = StepMemory(arguments=GiB, temporaries=12 * GiB, outputs=GiB, aliased=GiB)
    >>> [c.flag for c in candidates(step, 8 * GiB, None, configs.lm.get_config(), rows=8)][:3]
    ['--config.grad_accum_steps=2', '--config.model.remat=True', '--config.state_dtype=bfloat16']
  """
  activations = max(step.temporaries - _params_bytes(plan), 0)
  counts = [
      Candidate(
          f"--config.grad_accum_steps={n}",
          f"about {size(config.grad_accum_steps * activations // n)} of activations a microbatch",
          {"grad_accum_steps": n},
      )
      for n in _microbatch_counts(step, have, plan, config.grad_accum_steps, rows)
  ]
  found = [*counts[:1], *_remat(config), *_narrower(config)]
  found = [*found, *counts[1:]][:CANDIDATES]
  devices = "more devices on a config.mesh axis, or a smaller config.batch_size"
  return [*found, Candidate(devices, "params, state and batch split further", None)]


def _microbatch_counts(step: StepMemory, have: int, plan, count: int, rows: int) -> list[int]:
  """The microbatch counts above ``count`` that divide ``rows``, from the least that may fit."""
  activations = max(step.temporaries - _params_bytes(plan), 0)
  room = have - (step.total - activations)
  if room <= 0 or not activations:
    return []
  least = math.ceil(count * activations / room)
  return [n for n in range(max(least, count + 1), rows + 1) if rows % n == 0]


def _remat(config) -> list[Candidate]:
  """Rematerialisation, where the model has it off."""
  model = config.model or {}
  if "remat" not in model or model["remat"]:
    return []
  why = "recompute activations in the backward pass"
  return [Candidate("--config.model.remat=True", why, {"model.remat": True})]


def _narrower(config) -> list[Candidate]:
  """bfloat16 optimizer state, else bfloat16 params, where the config keeps them wider."""
  dtypes = precision.of_config(config)
  for key, what, dtype in (
      ("state_dtype", "optimizer state", dtypes.state),
      ("param_dtype", "params", dtypes.param),
  ):
    if dtype != "bfloat16":
      why = f"{what} stored in half the bytes"
      return [Candidate(f"--config.{key}=bfloat16", why, {key: "bfloat16"})]
  return []


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
  if plan is None:
    return 0
  return sum(e.bytes_per_device for e in plan.entries if e.name.split("/")[0] == "params")


def _plan_bytes(plan) -> int:
  return 0 if plan is None else plan.bytes_per_device
