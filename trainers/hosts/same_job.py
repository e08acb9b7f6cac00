"""One job on every host: each process of a job checks that all run the same job before allocating.

A host started with another ``lr``, ``seed``, data path, data file or package version would
plan the same shardings (``bvs.check_same_plan`` passes) and train a different job in lockstep.
:func:`check` compares, across every jax process, one line per fact of the job (:func:`job_lines`):
the facts the trainer gives (``--workdir``; the versions of Python, the project, jax, jaxlib,
flax, optax, orbax and the rest of ``provenance.PACKAGES``, and the git revision), every key of
the resolved config (after overrides) and the size of every data file the config names. One ``process_allgather`` of a digest when they agree; at the first difference every
process stops with one ``ConfigError`` naming the key, with this process's and the other's value
where both fit on a line.

Example:
  >>> import ml_collections
  >>> config = ml_collections.ConfigDict({"lr": 1e-3, "schedule": {"warmup_steps": 10}})
  >>> config_lines(config)
  ['config.lr=0.001', 'config.schedule.warmup_steps=10']
  >>> check(config, {"--workdir": "runs/lm"})  # one process: nothing to compare
"""

import os

import jax
import numpy as np
from jax.experimental import multihost_utils

import bv_sharding as bvs
from trainers.errors import ConfigError
from trainers.input import sources
from trainers.settings import schema

LINE_BYTES = 512  # What one process sends of its differing line.
SHOWN = 100  # A value longer than this is not quoted.


def check(config, facts: dict[str, str]) -> None:
  """Raises ``ConfigError`` on every process unless all run the same :func:`job_lines`.

  ``facts``: the rest of the job, by name (``--workdir``, the package versions).

  Call it on every process, after jax.distributed starts and before anything is allocated.
  """
  lines = job_lines(config, facts)
  rows = bvs.line_checksums(lines)
  if rows is None:
    return
  me = jax.process_index()
  # The first line any process differs at: the same index on every process.
  index = int(np.argmax((rows != rows[0]).any(axis=0)))
  other = next(p for p in range(len(rows)) if rows[p, index] != rows[me, index])
  everyone = gather_line(lines[index] if index < len(lines) else "")
  raise ConfigError(difference(everyone[me], everyone[other], other))


def difference(mine: str, theirs: str, other: int) -> str:
  """The one-line message for this process's ``mine`` and process ``other``'s ``theirs``.

  Example:
    >>> difference("config.lr=0.002", "config.lr=0.001", 0)
    'config.lr=0.002 here, 0.001 on process 0: every process of a job must run the same config, data files and packages; start them with the same command'
  """
  key, _, value = mine.partition("=")
  their_key, _, their_value = theirs.partition("=")
  if not theirs:
    what = f"{mine!r} here; process {other} has no such line"
  elif key != their_key:
    what = f"{key} here, {their_key} on process {other} (the jobs' keys differ)"
  elif len(value) <= SHOWN and len(their_value) <= SHOWN:
    what = f"{key}={value} here, {their_value} on process {other}"
  else:
    what = f"{key} differs from process {other}'s (values too long to show)"
  return (
      f"{what}: every process of a job must run the same config, data files and packages; "
      "start them with the same command"
  )


def job_lines(config, facts: dict[str, str]) -> list[str]:
  """``key=value`` lines: ``facts`` (sorted), the config's keys, its data files' sizes."""
  config = schema.of(config)
  return [
      *(f"{name}={value}" for name, value in sorted(facts.items())),
      *config_lines(config.source),
      *data_lines(config),
  ]


def config_lines(config) -> list[str]:
  """``config.<dotted key>=<repr>`` for every leaf of the resolved config, sorted."""
  return sorted(_flat("config", config.to_dict()))


def _flat(prefix: str, value) -> list[str]:
  if isinstance(value, dict) and value:
    return [line for k, v in value.items() for line in _flat(f"{prefix}.{k}", v)]
  return [f"{prefix}={value!r}"]


def data_lines(config) -> list[str]:
  """``size of <file>=<bytes>`` for every file ``config.input.train``/``val`` names."""
  if config.input is None:  # Models without a data section (tests' toy tasks).
    return []
  spec = sources.input_spec(config.input)
  if spec.kind not in ("tokens", "text"):
    return []
  files = [
      f
      for key in ("train", "val")
      if spec[key]
      for f in sources.find_files(spec[key], f"config.input.{key}")
  ]
  return [f"size of {f}={os.path.getsize(f)}" for f in files]


def gather_line(line: str) -> list[str]:
  """Every process's ``line`` (its first ``LINE_BYTES`` bytes), by process index."""
  mine = np.zeros(LINE_BYTES, np.uint8)
  data = line.encode()[:LINE_BYTES]
  mine[: len(data)] = np.frombuffer(data, np.uint8)
  rows = multihost_utils.process_allgather(mine)
  return [bytes(row).rstrip(b"\0").decode(errors="replace") for row in np.asarray(rows)]
