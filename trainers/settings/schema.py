"""The trainer's config keys, declared once: each key's type, default, meaning and check.

A config file (``configs/*.py``) returns an ``ml_collections.ConfigDict`` in big_vision's
spellings; :func:`of` reads it once into a frozen :class:`Config` whose attributes are those
keys (``config.lr``, ``config.mesh_axis_types``), typed, with their defaults. The keys come
in one small dataclass per concern (:class:`Data`, :class:`Model`, :class:`Dtypes`,
:class:`Sharding`, :class:`Memory`, :class:`Optimizer`, :class:`Steps`,
:class:`Checkpoints`), composed into :class:`Config` by inheritance, so every key keeps its
flat big_vision name.

Two kinds of key: the *shared* keys, which ``configs/common.py``'s ``base_config()`` sets at
their usual value (:func:`shared_defaults`: ``tests/trainer/test_schema.py`` checks they
agree), and each config's *own* keys (``total_steps``, ``batch_size``, ``lr``, the model,
the data), which it sets itself (None when it does not). A config that lacks a shared key
reads as ``base_config()`` would set it, except big_vision's ``wd`` and ``grad_clip_norm``
(absent: no decay, no clipping, as big_vision reads its configs) and ``ckpt_steps``
(absent: saved at the end and on preemption only).

Each key's check is declared with it (:class:`Int`, :class:`Number`, :class:`Choice`,
:class:`Pairs`, :class:`Names`, :class:`Dict`) and applied by
``trainers/settings/validation.py``, which also checks what spans keys; building the typed
config checks nothing and converts nothing. ``config.source`` is the ConfigDict read (its
nested dicts shared with the typed config's, so ``records.resolve`` filling in
``input.dtype`` shows in both): what ``workdir/config.json`` records and what big_vision's
optimizer section (``bv_sharding.big_vision``) reads.

Example:
  >>> import ml_collections
  >>> config = of(ml_collections.ConfigDict({"lr": 3e-3, "total_steps": 100}))
  >>> config.lr, config.on_nonfinite, config.mesh_axis_types, config.wd
  (0.003, 'stop', 'auto', 0.0)
  >>> of(config) is config  # already typed
  True
  >>> shared_defaults()["log_every"]
  20
"""

import dataclasses
import typing
from typing import Any

_SAME = object()
DTYPES = ("float32", "bfloat16")  # The names the dtype keys accept (trainers/precision.py).


@dataclasses.dataclass(frozen=True)
class Int:
  """Check: an integer (not a bool) >= ``minimum``, or None where ``none_ok``."""

  example: int
  minimum: int = 1
  none_ok: bool = False


@dataclasses.dataclass(frozen=True)
class Number:
  """Check: a finite number, > 0 if ``positive`` else >= 0, or None where ``none_ok``."""

  example: float
  positive: bool = True
  none_ok: bool = False


@dataclasses.dataclass(frozen=True)
class Choice:
  """Check: one of ``choices``, or None where ``none_ok``."""

  choices: tuple[str, ...]
  none_ok: bool = False


@dataclasses.dataclass(frozen=True)
class Pairs:
  """Check: a list of pairs (None: none, where ``none_ok``; one string, where ``text_ok``)."""

  example: str
  none_ok: bool = False
  text_ok: bool = False


@dataclasses.dataclass(frozen=True)
class Names:
  """Check: distinct, non-empty mesh axis names."""


@dataclasses.dataclass(frozen=True)
class Dict:
  """Check: a dict of ``what``, e.g. ``example``."""

  what: str
  example: str


def shared(base, doc: str, check=None, absent=_SAME):
  """A key ``base_config()`` sets to ``base``, checked by ``check`` (trainers/settings/
  validation.py applies it); a config lacking it reads ``absent`` (default: ``base`` too).

  Example: ``log_every: int = shared(20, "steps between logged steps", Int(20))``.
  """
  default = base if absent is _SAME else absent
  meta = {"doc": doc, "shared": True, "base": base, "check": check}
  if isinstance(default, dict):
    return dataclasses.field(default_factory=lambda: dict(default), metadata=meta)
  return dataclasses.field(default=default, metadata=meta)


def own(doc: str, check=None, optional: bool = False):
  """A key each config sets itself (None when it does not), checked by ``check``; an
  ``optional`` one only where the config sets it.

  Example: ``lr: float | None = own("the peak learning rate", Number(3e-3))``.
  """
  meta = {"doc": doc, "shared": False, "check": check, "optional": optional}
  return dataclasses.field(default=None, metadata=meta)


@dataclasses.dataclass(frozen=True)
class Data:
  """What the model reads: ``trainers/input/``."""

  input: Any = own(
      "the data: sources.input_config(...) (token files, text, images) or a name of "
      "sources.NAMED"
  )
  batch_size: int | None = own("the global batch: rows a step, over every process", Int(32))
  seq_len: int | None = own("tokens a row (sequence models only)", Int(128), optional=True)
  data_size: int | None = own("examples an epoch (big_vision's schedules in epochs)")
  num_devices: int | None = own("the devices trainers.plan plans for by default")
  eval_batches: int = shared(4, "held-out batches every eval reads, the same each time", Int(4))


@dataclasses.dataclass(frozen=True)
class Model:
  """The model and its init: ``trainers/models/``."""

  model_name: str | None = own("a model of trainers.models.MODELS: 'llama' or 'vit'")
  model: Any = own("the model's keyword arguments, e.g. dict(size='tiny')")
  seed: int = shared(0, "the init's and the batches' seed", Int(0, minimum=0))
  model_init: str | None = shared(
      None, "a workdir or checkpoint whose params start a run with no checkpoint of its own"
  )


@dataclasses.dataclass(frozen=True)
class Dtypes:
  """The dtype names: ``trainers/precision.py`` (float32 or bfloat16)."""

  compute_dtype: str = shared("float32", "activations and matmuls", Choice(DTYPES, True))
  param_dtype: str = shared(
      "float32", "the stored params (and so their gradients)", Choice(DTYPES, True)
  )
  state_dtype: str | None = shared(
      None, "optimizer state; None: the params' dtype", Choice(DTYPES, True)
  )


@dataclasses.dataclass(frozen=True)
class Sharding:
  """The mesh and what shards over it: ``bv_sharding``'s strategy and rules."""

  mesh: tuple = shared(
      (("data", -1),), "(axis, size) pairs; -1: the devices left", Pairs('[("data", -1)]')
  )
  dcn_mesh: tuple = shared((), "(axis, size) pairs across TPU slices; (): one slice")
  mesh_axis_types: str = shared(
      "auto",
      "'explicit': jax's sharding-in-types mesh (params gathered to their compute specs in "
      "the loss, activations resharded by sharding_rules); 'auto': XLA places the rest",
      Choice(("auto", "explicit")),
  )
  sharding_strategy: Any = own(
      "(regex, strategy) pairs placing params and optimizer state (or one strategy)",
      Pairs('[(".*", \'fsdp(axis="data")\')]', text_ok=True),
  )
  sharding_rules: tuple = shared(
      (("act_batch", "data"),),
      "(logical name, mesh axes) pairs",
      Pairs('[("act_batch", "data")]', none_ok=True),
  )
  data_axes: tuple = shared(
      (), "the axes a batch splits over; (): those act_batch maps to", Names()
  )


@dataclasses.dataclass(frozen=True)
class Memory:
  """The checks before a run: ``trainers/figures/memory.py``."""

  device_memory_gib: float | None = shared(
      None,
      "memory each device may use, GiB; None: ask the devices (CPU: the host's)",
      Number(80, none_ok=True),
  )
  max_unsharded_fraction: float | None = shared(
      None, "refuse to start when more of the state's bytes is unsharded; None: no gate"
  )


@dataclasses.dataclass(frozen=True)
class Optimizer:
  """big_vision's optimizer section: ``trainers/optimizers/from_config.py``."""

  optax_name: str = shared("adamw", "a project optimizer (adamw, kron, ...) or an optax name")
  optax: dict = shared(
      {},
      "the optimizer's keyword arguments, e.g. dict(b1=0.9)",
      Dict("optimizer keyword arguments", "--config.optax.b1=0.9"),
  )
  lr: float | None = own("the peak learning rate", Number(3e-3))
  wd: float = shared(1e-4, "decoupled weight decay", Number(1e-4, positive=False), absent=0.0)
  grad_clip_norm: float | None = shared(
      1.0, "global norm clipping; None: none", Number(1.0, none_ok=True), absent=None
  )
  schedule: Any = own("big_vision's schedule: a dict, or (regex, dict | None) pairs")
  rewarmup_steps: int = shared(
      5,
      "steps over which an optimizer state born mid-run (another optax_name on resume) is "
      "ramped in, min(1, n / rewarmup_steps); 0: not ramped",
      Int(100, minimum=0),
  )


@dataclasses.dataclass(frozen=True)
class Steps:
  """The loop: ``trainers/loop.py``, ``trainers/steps.py``."""

  total_steps: int | None = own("steps the run ends at", Int(300))
  grad_accum_steps: int = shared(1, "microbatches each global batch is split into", Int(2))
  log_every: int = shared(20, "steps between logged steps", Int(20))
  eval_every: int = shared(100, "steps between evals", Int(20))
  on_nonfinite: str = shared(
      "stop", "a NaN/inf loss ends the run; 'skip': skip that update", Choice(("stop", "skip"))
  )
  profile_steps: tuple | None = shared(
      None, "(start, stop): a jax.profiler trace of steps start..stop-1; None: no trace"
  )


@dataclasses.dataclass(frozen=True)
class Checkpoints:
  """big_vision's checkpoint keys: ``trainers/rundir/checkpoint.py``."""

  ckpt_steps: int | None = shared(
      100,
      "save every ckpt_steps (and at the end, and on SIGTERM); None: only then",
      Int(100, none_ok=True),
      absent=None,
  )
  keep_ckpt_steps: int | None = shared(
      None,
      "keep the checkpoints at multiples of it for good (else only the latest)",
      Int(100, none_ok=True),
  )


@dataclasses.dataclass(frozen=True)
class Config(Checkpoints, Steps, Optimizer, Memory, Sharding, Dtypes, Model, Data):
  """A run's config, typed: every key of the concerns above (listed last to first: a
  dataclass's fields start with its last base's), and ``source``, the ConfigDict it was
  read from (:func:`of`).

  Example: ``of(configs.lm.get_config()).batch_size`` == 32.
  """

  source: Any = dataclasses.field(default=None, repr=False, compare=False)


def keys() -> dict[str, dataclasses.Field]:
  """Every declared key, by name.

  Example: ``keys()["lr"].metadata["doc"]`` == "the peak learning rate".
  """
  return {f.name: f for f in dataclasses.fields(Config) if "doc" in f.metadata}


def shared_defaults() -> dict[str, Any]:
  """The shared keys at the values ``configs/common.py``'s ``base_config()`` sets.

  Example: ``shared_defaults()["on_nonfinite"]`` == "stop".
  """
  return {name: f.metadata["base"] for name, f in keys().items() if f.metadata["shared"]}


def of(config) -> Config:
  """The typed :class:`Config` of ``config`` (a ConfigDict or a dict, kept as it is as
  ``source``; or already a Config).

  Example: ``of(configs.lm.get_config()).mesh_axis_types`` == "auto".
  """
  if isinstance(config, Config):
    return config
  values = {name: config.get(name, _default(f)) for name, f in keys().items()}
  return Config(**values, source=config)


def sets(config: Config, key: str) -> bool:
  """Whether the config read sets ``key`` (to None too), unlike one that lacks it.

  Example: ``sets(of({"seq_len": None}), "seq_len")`` is True; ``sets(of({}), "seq_len")``
  is False.
  """
  return key in config.source


def placeholder_type(name: str) -> type | None:
  """The type a key holds when set (the non-None part of its annotation).

  Example: ``placeholder_type("device_memory_gib")`` is float.
  """
  hint = typing.get_type_hints(Config)[name]
  kinds = [t for t in typing.get_args(hint) if t is not type(None)] or [hint]
  return typing.get_origin(kinds[0]) or kinds[0]


def _default(f: dataclasses.Field):
  if f.default_factory is not dataclasses.MISSING:
    return f.default_factory()
  return f.default
