"""What the trainer takes from the records beside token files, and the scans it caches.

``python -m trainers.convert`` writes ``<file>.json`` beside each token file (dtype, vocab
size, end-of-text id, token and document counts, largest id, bytes of text, tokenizer).
:func:`resolve` fills in what a config leaves unset from them, before anything is planned:

* ``config.input.dtype = ""``: the recorded dtype (no record: uint16, nanoGPT's);
* ``config.model.vocab_size = 0``: the recorded vocab size rounded up to a multiple of
  :data:`VOCAB_MULTIPLE` (128; accelerator kernels tile the embedding and the logits by
  it), 256 for ``kind="text"``.

An explicit value that contradicts the record (another dtype, a vocab below the
recorded one) is a ``ConfigError``. :class:`ScanCache` gives the id check the largest id
of a file without a record: scanned once, by process 0, kept in the workdir's
``token_scan.json`` for later starts, and broadcast to the other processes.

Example:
  >>> import json, os, tempfile
  >>> import ml_collections
  >>> folder = tempfile.mkdtemp()
  >>> np.arange(300, dtype=np.uint16).tofile(f"{folder}/train.bin")
  >>> with open(f"{folder}/train.bin.json", "w") as f:
  ...   json.dump({"dtype": "uint16", "tokens": 300, "max_token": 299, "vocab_size": 300}, f)
  >>> config = ml_collections.ConfigDict(dict(
  ...     input=sources.input_config(kind="tokens", train=f"{folder}/train.bin", dtype=""),
  ...     model=dict(size="tiny", vocab_size=0)))
  >>> config = resolve(config)
  >>> config.input.dtype, config.model.vocab_size
  ('uint16', 384)
"""

import json
import os
import time

import numpy as np
from absl import logging
from etils import epath

from trainers.errors import ConfigError
from trainers.input import sources, tokenizer

VOCAB_MULTIPLE = 128
NANOGPT_DTYPE = "uint16"
SCANS = "token_scan.json"
TOKEN_KINDS = ("tokens", "text")


def round_vocab(vocab: int) -> int:
  """``vocab`` rounded up to a multiple of VOCAB_MULTIPLE.

  Example: ``round_vocab(50_257)`` == 50_304.
  """
  return -(-vocab // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


def recorded(spec) -> tuple[dict, str]:
  """(the record every train/val file shares, the first file's name); ({}, "") if none has one.

  Files whose records disagree on dtype, vocab size or tokenizer are a ``ConfigError``.
  """
  keys = ("dtype", "vocab_size", "tokenizer_sha256")
  found = {}
  for key in ("train", "val") if spec.val else ("train",):
    for name in sources.find_files(spec[key], f"config.input.{key}"):
      record = sources.sidecar(name)
      if not record:
        continue
      for first, earlier in found.items():
        same = all(record.get(k) == earlier.get(k) for k in keys)
        if not same:
          raise ConfigError(
              f"{name}.json and {first}.json disagree on {keys}: the files were made with "
              "different tokenizers; convert them again with one"
          )
      found.setdefault(name, record)
  return (next(iter(found.values())), next(iter(found))) if found else ({}, "")


def resolve(config):
  """``config`` with ``input.dtype`` and ``model.vocab_size`` from the record where unset.

  A config whose input is no token data, or whose model has no ``vocab_size`` key (a
  preset's), is returned as it is. Example: ``config = resolve(config)`` before planning.
  """
  spec = sources.input_spec(config.input)
  if spec.kind not in TOKEN_KINDS:
    return config
  record, name = recorded(spec) if spec.kind == "tokens" else ({}, "")
  if spec.kind == "tokens":
    config.input.dtype = checked_dtype(spec.dtype, record, name)
  if "vocab_size" in config.model:
    config.model.vocab_size = checked_vocab(config.model.vocab_size, spec.kind, record, name)
  return config


def checked_dtype(dtype: str, record: dict, name: str) -> str:
  """``dtype`` (config.input.dtype; "" = the record's), once it agrees with the record."""
  if not dtype:
    return record.get("dtype", NANOGPT_DTYPE)
  if record and record.get("dtype", dtype) != dtype:
    raise ConfigError(
        f"config.input.dtype={dtype!r} contradicts {name}.json (dtype {record['dtype']!r}); "
        "leave it out (dtype=) to take the record's, or set it to that"
    )
  return dtype


def checked_vocab(vocab: int, kind: str, record: dict, name: str) -> int:
  """``vocab`` (config.model.vocab_size; 0 = the record's, rounded up), checked against it."""
  if kind == "text":
    return vocab or tokenizer.BYTE_VOCAB
  if "vocab_size" not in record:
    if vocab:
      return vocab
    where = f"{name}.json has no vocab_size" if record else "the token files have no record"
    raise ConfigError(
        f"config.model.vocab_size is unset and {where} (`python -m trainers.convert` writes "
        "one); set it, e.g. configs/lm_data.py:...,vocab=50304"
    )
  if not vocab:
    return round_vocab(record["vocab_size"])
  if vocab < record["vocab_size"]:
    raise ConfigError(
        f"config.model.vocab_size={vocab} is below the {record['vocab_size']} ids of "
        f"{name}.json; leave it out (vocab=) to take {round_vocab(record['vocab_size'])} "
        "(the record's, rounded up to a multiple of 128), or set one at least that large"
    )
  return vocab


def bytes_per_token(stream: sources.TokenStream, kind: str) -> float | None:
  """Bytes of text per token of ``stream``'s files, from their records (text: 1; None: unknown).

  Example: ``loss / math.log(2) / bytes_per_token(held_out, "tokens")`` is bits per byte.
  """
  if kind == "text":
    return 1.0
  records = [sources.sidecar(name) for name in stream.names]
  if not all("text_bytes" in r and r.get("tokens") for r in records):
    return None
  return sum(r["text_bytes"] for r in records) / sum(r["tokens"] for r in records)


class ScanCache:
  """The largest token id of each file for the id check: its record, the cache, else a scan.

  Only the main process scans; it keeps what it found in ``workdir/token_scan.json`` (keyed
  by the file's path, size and modification time) once :meth:`save` is called, and
  ``share`` (``multihost_utils.broadcast_one_to_all`` with several processes) gives its
  values to the others. Called in the same order with the same files on every process.

  Example: ``task.check(model, ScanCache(workdir, jax.process_index() == 0, share))``.
  """

  def __init__(self, workdir: str, is_main: bool, share=None):
    self.path, self.is_main, self.share = epath.Path(workdir) / SCANS, is_main, share
    try:  # The workdir may be a gs:// URL: etils.epath, as everything the run writes.
      self.known = json.loads(self.path.read_text())
    except (FileNotFoundError, ValueError):
      self.known = {}
    self.scanned = 0

  def __call__(self, array: np.ndarray, name: str) -> int:
    record = sources.sidecar(name)
    if record.get("tokens") == len(array) and "max_token" in record:
      return record["max_token"]
    largest = self.look_up(array, name) if self.is_main else 0
    return int(self.share(np.int64(largest))) if self.share else largest

  def look_up(self, array: np.ndarray, name: str) -> int:
    """The main process's value: the cache's if the file is unchanged, else a scan."""
    key, stat = os.path.abspath(name), os.stat(name)
    entry = {"bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    known = self.known.get(key, {})
    if {k: known.get(k) for k in entry} == entry:
      logging.info("largest token id of %s: %d (from %s)", name, known["max_token"], self.path)
      return known["max_token"]
    began = time.perf_counter()
    largest = sources.chunked(np.max, array)
    self.scanned += 1
    logging.info(
        "scanned %s for its largest token id: %d (%d tokens, %.1f s); kept in %s",
        name,
        largest,
        len(array),
        time.perf_counter() - began,
        self.path,
    )
    self.known[key] = {**entry, "max_token": largest}
    return largest

  def save(self) -> None:
    """Writes what the main process scanned (after every check passed; a rename, so whole)."""
    if self.is_main and self.scanned:
      self.path.parent.mkdir(parents=True, exist_ok=True)
      partial = self.path.parent / f"{self.path.name}.partial-{os.getpid()}"
      partial.write_text(json.dumps(self.known, indent=1))
      partial.replace(self.path)
