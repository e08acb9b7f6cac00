"""The data sources ``config.input`` names: token files, text corpora, .npy images, digits.

``config.input`` is a dict in big_vision's manner (every key below; "" and 0 mean
unset so that each key can be overridden on the command line):

  kind           "tokens" (flat uint8/uint16/uint32 token ids, nanoGPT's
                 train.bin/val.bin), "text" (UTF-8 files as byte tokens),
                 "images" (a directory with images.npy uint8 (N, H, W, C) and
                 labels.npy integer (N,)) or "digits" (sklearn's 8x8 digits).
  train          a file, a glob or a directory (tokens, text), or the directory
                 holding images.npy and labels.npy (images).
  val            the same for held-out data; "" = the last ``eval_fraction`` of train.
  eval_fraction  the held-out tail of train when ``val`` is "".
  tune_fraction  tokens, text: hold out this fraction of train just before its eval
                 tail (its very end when ``val`` is set) as a tuning slice, and
                 evaluate that slice instead of the eval split, to choose
                 hyperparameters on data the reported eval loss never sees; 0 = off.
  dtype          the token files' dtype (tokens; text is always uint8); "" = the one
                 recorded beside them by trainers.convert (none: uint16).
  vocab_size     the data's vocabulary; 0 = the largest token id + 1. Token ids
                 must be below it and below the model's ``vocab_size``.
  max_tokens     use only the first max_tokens of train; 0 = all.
  prefetch       batches prepared and transferred to the devices ahead of the step.

Token and text files are opened with ``np.memmap`` and never read whole: a
``TokenStream`` is the concatenation of its files, windows are read row by row.
The old string form ``config.input = "text"`` (the Python standard library's
source) or ``"digits"`` still works.

Example:
  >>> import tempfile
  >>> folder = tempfile.mkdtemp()
  >>> np.arange(300, dtype=np.uint16).tofile(f"{folder}/train.bin")
  >>> np.arange(100, dtype=np.uint16).tofile(f"{folder}/val.bin")
  >>> spec = input_spec(input_config(kind="tokens", train=f"{folder}/train.bin",
  ...                                val=f"{folder}/val.bin"))
  >>> train, held_out = open_tokens(spec)  # two TokenStreams, nothing read yet
  >>> len(train), len(held_out)
  (300, 100)
  >>> train.windows(np.array([0, 5]), 129).shape
  (2, 129)
"""

import dataclasses
import glob
import json
import os
import sysconfig
from typing import Any

import jax
import ml_collections
import numpy as np
from absl import logging

from trainers.errors import ConfigError

STDLIB_TEXT = os.path.join(sysconfig.get_paths()["stdlib"], "*.py")
DEFAULTS = dict(
    kind="",
    train="",
    val="",
    eval_fraction=0.05,
    tune_fraction=0.0,
    dtype="uint16",
    vocab_size=0,
    max_tokens=0,
    prefetch=2,
)
KINDS = ("tokens", "text", "images", "digits")
TOKEN_DTYPES = ("uint8", "uint16", "uint32")
SCAN_CHUNK = 2**24  # Token ids scanned per np.max call: 32-64 MiB of memory at a time.
# The string form of config.input, kept working: the embedded default corpora.
NAMED = {
    "text": dict(kind="text", train=STDLIB_TEXT, max_tokens=4 * 2**20),
    "digits": dict(kind="digits"),
}


def input_config(**overrides) -> dict:
  """Every ``config.input`` key with its default, ``overrides`` replacing some.

  Example: ``config.input = input_config(kind="tokens", train="/data/train.bin")``.
  """
  unknown = sorted(set(overrides) - set(DEFAULTS))
  if unknown:
    raise ConfigError(f"config.input has no keys {unknown}; its keys are {sorted(DEFAULTS)}")
  return {**DEFAULTS, **overrides}


def input_spec(value) -> ml_collections.ConfigDict:
  """``config.input`` (a dict or a name of NAMED) as a ConfigDict with every key, checked.

  Example: ``input_spec("text").kind == "text"``.
  """
  if isinstance(value, str):
    if value not in NAMED:
      raise ConfigError(
          f"config.input={value!r} is not a named input; use one of {sorted(NAMED)} or a dict "
          f"with kind in {KINDS} (see trainers/input/sources.py)"
      )
    value = NAMED[value]
  spec = ml_collections.ConfigDict(input_config(**dict(value)))
  if spec.kind not in KINDS:
    raise ConfigError(f"config.input.kind={spec.kind!r} is not one of {KINDS}")
  if spec.kind == "tokens" and spec.dtype not in ("", *TOKEN_DTYPES):
    raise ConfigError(
        f"config.input.dtype={spec.dtype!r} is not a token dtype; use one of {TOKEN_DTYPES} "
        "(nanoGPT's train.bin is uint16)"
    )
  if not 0 <= spec.eval_fraction < 1:
    raise ConfigError(f"config.input.eval_fraction={spec.eval_fraction} must be in [0, 1)")
  held = spec.tune_fraction + (0 if spec.val else spec.eval_fraction)
  if spec.tune_fraction < 0 or held >= 1:
    raise ConfigError(
        f"config.input.tune_fraction={spec.tune_fraction} must be >= 0 and leave train some "
        f"data (tune_fraction + eval_fraction < 1); 0.05 is typical"
    )
  if spec.tune_fraction and spec.kind not in ("tokens", "text"):
    raise ConfigError(
        f"config.input.tune_fraction={spec.tune_fraction} applies to kind 'tokens' or 'text', "
        f"not {spec.kind!r}; set it to 0"
    )
  for key in ("vocab_size", "max_tokens"):
    if spec[key] < 0:
      raise ConfigError(f"config.input.{key}={spec[key]} must be >= 0 (0 = unset)")
  if spec.prefetch < 1:
    raise ConfigError(f"config.input.prefetch={spec.prefetch} must be at least 1 (2 is typical)")
  return spec


def find_files(pattern: str, what: str) -> list[str]:
  """The sorted files ``pattern`` (a file, a glob or a directory, searched recursively) names.

  ``what`` names the setting in errors. The ``.json`` records ``python -m trainers.convert``
  writes beside its token files are left out.

  Example: ``find_files("/data/shards/*.bin", "config.input.train")`` -> ["/data/shards/000.bin"].
  """
  if not pattern:
    raise ConfigError(f"{what} is empty; set it to a file, a glob or a directory")
  if "://" in pattern:
    raise ConfigError(
        f"{what}={pattern!r} is a URL; files are memory-mapped from local disk: stage them first "
        "(e.g. gcloud storage cp -r gs://bucket/data /data) and point it at the local copy"
    )
  path = os.path.expanduser(pattern)
  if os.path.isdir(path):
    path = os.path.join(path, "**", "*")
  elif not glob.has_magic(path):
    if not os.path.isfile(path):
      raise ConfigError(
          f"{what}: {path} does not exist; point it at an existing file, glob or "
          "directory (e.g. the train.bin `python -m trainers.convert` writes)"
      )
    return [path]
  files = once_each(sorted(f for f in glob.glob(path, recursive=True) if os.path.isfile(f)))
  names = set(files)
  files = [f for f in files if not (f.endswith(".json") and f[: -len(".json")] in names)]
  if not files:
    raise ConfigError(
        f"{what}={pattern!r} matches no files; check the path and the glob "
        "(a directory is searched recursively)"
    )
  return files


def once_each(files: list[str]) -> list[str]:
  """``files`` with each file once: a path that a link (a looping one too) makes name a file
  already listed is dropped, with one warning saying how many.

  Example: ``once_each(["a/x.txt", "a/loop/x.txt"])`` -> ``["a/x.txt"]`` when ``a/loop`` -> ``a``.
  """
  first = {}
  for f in files:
    first.setdefault(os.path.realpath(f), f)
  if len(first) < len(files):
    logging.warning(
        "%d paths name files already listed through symbolic links (e.g. %s); each file is read "
        "once",
        len(files) - len(first),
        next(f for f in files if f not in first.values()),
    )
  return list(first.values())


@dataclasses.dataclass(frozen=True)
class TokenStream:
  """Tokens [start, stop) of the concatenation of ``arrays`` (memmaps), with their file ``names``.

  Windows may cross from one file into the next, as in one concatenated stream.

  Example:
    >>> s = TokenStream((np.arange(5), np.arange(5, 9)), ("a", "b"))
    >>> s.windows(np.array([3]), 3)
    array([[3, 4, 5]], dtype=int32)
  """

  arrays: tuple
  names: tuple
  start: int = 0
  stop: int | None = None
  ends: np.ndarray = dataclasses.field(init=False, repr=False)  # Each file's end in the stream.

  def __post_init__(self):
    object.__setattr__(self, "ends", np.cumsum([len(a) for a in self.arrays]))
    total = int(self.ends[-1])
    object.__setattr__(self, "stop", total if self.stop is None else min(self.stop, total))

  def __len__(self) -> int:
    return self.stop - self.start

  def split(self, cut: int) -> tuple["TokenStream", "TokenStream"]:
    """(first ``cut`` tokens, the rest)."""
    middle = self.start + cut
    return (
        dataclasses.replace(self, stop=middle),
        dataclasses.replace(self, start=middle),
    )

  def windows(self, starts: np.ndarray, length: int) -> np.ndarray:
    """int32 (len(starts), length): the tokens from each of ``starts`` (relative to ``start``)."""
    ends = self.ends
    out = np.empty((len(starts), length), np.int32)
    for row, position in enumerate(np.asarray(starts, np.int64) + self.start):
      i, filled = int(np.searchsorted(ends, position, side="right")), 0
      while filled < length:
        offset = position + filled - (ends[i - 1] if i else 0)
        piece = self.arrays[i][offset : offset + length - filled]
        out[row, filled : filled + len(piece)] = piece
        filled, i = filled + len(piece), i + 1
    return out


def sidecar(path: str) -> dict:
  """What ``python -m trainers.convert`` recorded about ``path`` ({} if nothing).

  Example: ``sidecar("/data/train.bin").get("max_token")``.
  """
  try:
    with open(path + ".json") as f:
      return json.load(f)
  except FileNotFoundError:
    return {}


def chunked(reduce, array: np.ndarray) -> int:
  """``reduce`` (np.min, np.max) of a memmap, SCAN_CHUNK elements in memory at a time.

  Example: ``chunked(np.max, np.memmap("/data/train.bin", np.uint16, mode="r"))``.
  """
  return int(reduce([reduce(array[i : i + SCAN_CHUNK]) for i in range(0, len(array), SCAN_CHUNK)]))


def max_token(array: np.ndarray, name: str) -> int:
  """The largest id in file ``name``: from convert's record when it matches, else a chunked scan.

  Example: ``max_token(np.memmap("/data/train.bin", np.uint16, mode="r"), "/data/train.bin")``.
  """
  record = sidecar(name)
  if record.get("tokens") == len(array) and "max_token" in record:
    return record["max_token"]
  return chunked(np.max, array)


def check_token_ids(
    stream: TokenStream, model_vocab: int, declared: int = 0, largest=max_token
) -> None:
  """Raises unless every token id of ``stream``'s files is below the vocabularies.

  ``declared`` is config.input.vocab_size (0: none). Skips the scan when the dtype
  cannot hold an id that large. ``largest(array, name)`` gives a file's largest id
  (:func:`max_token`; the trainer's caches its scans: ``records.ScanCache``).

  Example: ``check_token_ids(train, model.config.vocab_size, spec.vocab_size)``.
  """
  if declared > model_vocab:
    raise ConfigError(
        f"config.input.vocab_size={declared} is larger than the model's vocab_size={model_vocab}; "
        f"set config.model.vocab_size={declared} (or larger)"
    )
  limit = declared or model_vocab
  for array, name in zip(stream.arrays, stream.names):
    if np.iinfo(array.dtype).max < limit:
      continue
    found = largest(array, name)
    if found >= limit:
      fix = (
          f"config.input.vocab_size={declared}: the file does not match it"
          if declared
          else f"the model's vocab_size={model_vocab}: set config.model.vocab_size={found + 1} "
          "(or larger)"
      )
      raise ConfigError(f"{name} holds token id {found}, not below {fix}")


def memmap_tokens(path: str, dtype: str) -> np.memmap:
  """``path`` as a read-only memmap of ``dtype``, its size checked.

  Example: ``memmap_tokens("/data/train.bin", "uint16")``.
  """
  dtype = dtype or sidecar(path).get("dtype", "uint16")  # "": the record's, else nanoGPT's.
  size, itemsize = os.path.getsize(path), np.dtype(dtype).itemsize
  if size == 0:
    raise ConfigError(f"{path} is empty; remove it from config.input or write tokens into it")
  if size % itemsize:
    raise ConfigError(
        f"{path} has {size} bytes, not a multiple of {dtype}'s {itemsize}: is config.input.dtype "
        "right? (nanoGPT writes uint16; `python -m trainers.convert` records the dtype in "
        f"{os.path.basename(path)}.json)"
    )
  recorded = sidecar(path).get("dtype", dtype)
  if recorded != dtype:
    raise ConfigError(
        f"{path} holds {recorded} tokens ({path}.json) but config.input.dtype={dtype!r}; set "
        f"config.input.dtype={recorded!r}"
    )
  return np.memmap(path, dtype=dtype, mode="r")


def token_stream(spec: ml_collections.ConfigDict, key: str) -> TokenStream:
  """The files of config.input.<key> as one TokenStream (text: every non-empty file as bytes).

  Example: ``token_stream(spec, "train")``.
  """
  files = find_files(spec[key], f"config.input.{key}")
  if spec.kind == "text":
    files = [f for f in files if os.path.getsize(f)]
    if not files:
      raise ConfigError(f"config.input.{key}={spec[key]!r} has only empty files; add text")
  dtype = "uint8" if spec.kind == "text" else spec.dtype
  return TokenStream(tuple(memmap_tokens(f, dtype) for f in files), tuple(files))


def token_slices(spec: ml_collections.ConfigDict) -> dict[str, TokenStream]:
  """{"train", "tune", "eval"} TokenStreams of a "tokens" or "text" spec; nothing is read.

  Without ``val``, train's stream (its first ``max_tokens``) is cut into [train | tune |
  eval]: eval its last ``eval_fraction``, tune the ``tune_fraction`` before it (empty at
  0), so the eval slice is the same whatever ``tune_fraction`` is. With ``val``, eval is
  the val files and tune train's last ``tune_fraction``.

  Example: ``token_slices(input_spec("text"))["eval"]``.
  """
  stream = token_stream(spec, "train")
  if spec.max_tokens:
    stream = stream.split(spec.max_tokens)[0]
  n = len(stream)
  tune = round(n * spec.tune_fraction)
  train, rest = stream.split(n - tune - (0 if spec.val else round(n * spec.eval_fraction)))
  tune, tail = rest.split(tune)
  return {"train": train, "tune": tune, "eval": token_stream(spec, "val") if spec.val else tail}


def open_tokens(spec: ml_collections.ConfigDict) -> tuple[TokenStream, TokenStream]:
  """(train, held-out) TokenStreams of a "tokens" or "text" spec; nothing is read.

  The held-out stream is :func:`token_slices`' tune slice when ``tune_fraction`` is set,
  else its eval slice.

  Example: ``train, held_out = open_tokens(input_spec("text"))``.
  """
  slices = token_slices(spec)
  return slices["train"], slices["tune" if spec.tune_fraction else "eval"]


def check_length(stream: TokenStream, seq_len: int, what: str, fix: str) -> None:
  """Raises if ``stream`` (``what``, in words) is shorter than one window of ``seq_len + 1`` tokens.

  Example: ``check_length(held_out, config.seq_len, "config.input.val", "a longer file")``.
  """
  if len(stream) <= seq_len:
    names = stream.names[0] if len(stream.names) == 1 else f"{len(stream.names)} files"
    raise ConfigError(
        f"{what} ({names}) has {len(stream)} tokens, fewer than config.seq_len + 1 = "
        f"{seq_len + 1}; use a shorter config.seq_len or {fix}"
    )


def load_npy(directory: str, name: str, key: str) -> np.ndarray:
  """``directory/name`` memory-mapped (.npz cannot be: save each array with np.save).

  Example: ``load_npy("/data/train", "images.npy", "train")``.
  """
  path = os.path.join(os.path.expanduser(directory), name)
  if not os.path.isfile(path):
    npz = glob.glob(os.path.join(os.path.expanduser(directory), "*.npz"))
    hint = f" ({npz[0]} is .npz, which cannot be memory-mapped)" if npz else ""
    raise ConfigError(
        f"config.input.{key}: {path} does not exist{hint}; save images (uint8 N,H,W,C) and labels "
        "(integer N) with np.save as images.npy and labels.npy in that directory"
    )
  return np.load(path, mmap_mode="r")


def open_image_split(spec: ml_collections.ConfigDict, key: str) -> dict:
  """{"image": uint8 (N, H, W, C), "label": (N,)} memmaps of config.input.<key>, checked.

  Example: ``open_image_split(spec, "train")["image"].shape``.
  """
  if not spec[key]:
    raise ConfigError(f"config.input.{key} is empty; set it to a directory with images.npy")
  split = {"image": load_npy(spec[key], "images.npy", key)}
  split["label"] = load_npy(spec[key], "labels.npy", key)
  images, labels = split["image"], split["label"]
  where = os.path.join(spec[key], "images.npy")
  if images.dtype != np.uint8 or images.ndim != 4 or not len(images):
    raise ConfigError(
        f"{where} is {images.dtype} {images.shape}; expected uint8 (N, H, W, C), N > 0: save "
        "images.astype(np.uint8), with a channel axis"
    )
  if not np.issubdtype(labels.dtype, np.integer) or labels.shape != images.shape[:1]:
    raise ConfigError(
        f"{os.path.join(spec[key], 'labels.npy')} is {labels.dtype} {labels.shape}; expected "
        f"integer ({len(images)},), one label per image"
    )
  return split


def check_labels(split: dict, num_classes: int, key: str) -> None:
  """Raises unless every label of ``split`` is in [0, num_classes).

  Example: ``check_labels(train, model.num_classes, "train")``.
  """
  labels = split["label"]
  low, high = chunked(np.min, labels), chunked(np.max, labels)
  where = getattr(labels, "filename", None) or f"config.input.{key}"
  if low < 0 or high >= num_classes:
    raise ConfigError(
        f"{where} holds labels in [{low}, {high}] but the model has "
        f"{num_classes} classes; set config.model.num_classes={high + 1} or fix the labels"
    )


def holdout_split(data: Any, eval_fraction: float) -> tuple[Any, Any]:
  """Splits every leaf of ``data`` along axis 0 into (head, last eval_fraction).

  Example: ``holdout_split(np.arange(10), 0.2)`` -> (arange(8), [8, 9]).
  """
  n = len(jax.tree.leaves(data)[0])
  cut = n - round(n * eval_fraction)
  return (jax.tree.map(lambda x: x[:cut], data), jax.tree.map(lambda x: x[cut:], data))


def load_digits(eval_fraction: float = 0.2) -> tuple[dict, dict]:
  """Returns (train, eval) dicts of sklearn's 1797 8x8 digits.

  "image" is float32 (N, 8, 8, 1) in [0, 1]; "label" is int32 (N,). The eval
  split is the last ``eval_fraction`` of the (fixed) dataset order.

  Example: ``train, test = load_digits(); train["image"].shape[1:] == (8, 8, 1)``.
  """
  try:
    from sklearn import datasets  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ImportError("Image data needs scikit-learn: `pip install scikit-learn`.") from e
  digits = datasets.load_digits()
  data = {
      "image": (digits.images[..., None] / 16.0).astype(np.float32),
      "label": digits.target.astype(np.int32),
  }
  return holdout_split(data, eval_fraction)
