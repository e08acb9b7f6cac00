"""Converts a corpus once into token files: train.bin, val.bin, their records (and a tokenizer).

  python -m trainers.convert ~/my_text /data/my_text                    # bytes (vocab 256)
  python -m trainers.convert ~/my_text /data/bpe --train_tokenizer --vocab_size=8192
  python -m trainers.convert '/hub/*.parquet' /data/gpt2 --tokenizer=gpt2/tokenizer.json
  python -m trainers.convert /hub/docs.jsonl /data/d --tokenizer=t.json --text_field=content

The corpus is text files (a directory, recursively, or a glob; one document per file, or per
stretch between ``--separator``s, e.g. ``--separator='<|endoftext|>'``; ``\\n`` in it is a
newline), JSONL or Parquet (one document per line or row, its ``--text_field``):
trainers/input/documents.py.
Files in a directory that are not UTF-8 text are skipped, with one line saying how many.

Without a tokenizer the ids are the UTF-8 bytes (uint8, vocab 256, nothing between
documents), as before. ``--tokenizer PATH`` encodes with a Hugging Face ``tokenizer.json``;
``--train_tokenizer --vocab_size N`` first trains a byte-level BPE on the corpus and saves it
as ``OUT_DIR/tokenizer.json``. With a tokenizer each document ends with its end-of-text id and
the files are uint16 up to 65,536 ids, else uint32 (``--dtype`` forces a wider one).

The first 1 - val_fraction of the input's bytes go to train.bin, the rest to val.bin: a
text file crossing that cut is split there (its first part ends train.bin without an
end-of-text id), a JSONL line or Parquet row crossing it goes to val.bin. Each output gets
``<name>.json``: dtype, token and document counts, the largest id, the bytes of text
(bytes per token, for bits per byte), vocab size, end-of-text id and the tokenizer's path
and SHA-256; the trainer takes the vocabulary and dtype from it.

Documents stream in pieces (at most 16 MiB of a long file at a time) and are encoded in
batches by ``--workers`` processes (default: every core, one tokenizer thread each; 1: here,
with the library's threads; bytes need none), written in input order, so the output does not
depend on the worker count. Progress (MiB, rate, ETA)
goes to stderr. The outputs are written into a directory of this run's inside ``OUT_DIR`` and
committed together by one rename (trainers/input/committed.py): ``OUT_DIR/train.bin`` and
the others are symlinks through ``OUT_DIR/.current``, so a run killed at any moment leaves the
last complete output whole (or none), never one file of each; the next run removes what it
left, says so, and redoes it.
A bad input (a path that names no file, a non-UTF-8 file named explicitly, a missing text
field, an empty corpus, a tokenizer that cannot be read, an ``out_dir`` that cannot be
made) ends as one line, ``ConfigError: ...``, exit status 1 (``--debug``: the traceback).

Example:
  >>> import os, tempfile
  >>> corpus, out = tempfile.mkdtemp(), tempfile.mkdtemp()
  >>> with open(os.path.join(corpus, "a.txt"), "w") as f:
  ...   _ = f.write("hello world " * 10)
  >>> convert(documents.Corpus.of(corpus), out, val_fraction=0.1)
  {'train': 108, 'val': 12}
  >>> sources.sidecar(os.path.join(out, "val.bin"))["max_token"] == ord("w")
  True
"""

import collections
import json
import multiprocessing
import os
import shutil
import sys
import time
from collections.abc import Iterator

import numpy as np

from trainers.errors import ConfigError
from trainers.input import committed, documents, sources
from trainers.input import tokenizer as tokenizers_lib
from trainers.settings import cli

BATCH = 2**20  # Bytes of text per batch a worker encodes.
SPLITS = ("train", "val")
TOKENIZER = "tokenizer.json"  # A trained tokenizer, in the output directory.
# The most ids --vocab_size may ask for: a BPE trainer allocates per id before it starts (2**32
# ids took 283 GB), and the largest vocabularies in use have 2**18.
MAX_VOCAB = 2**20


class Progress:
  """Prints ``done / total`` MiB, the rate and the time left to ``stream``, at most once a second."""

  def __init__(self, total: int, stream=None):
    self.total, self.stream, self.done = total, stream or sys.stderr, 0
    self.start = self.last = time.monotonic()

  def advance(self, n: int) -> None:
    self.done += n
    now = time.monotonic()
    if now - self.last >= 1 or self.done >= self.total:
      self.last = now
      rate = self.done / max(now - self.start, 1e-9)
      eta = (self.total - self.done) / max(rate, 1e-9)
      print(
          f"converted {self.done / 2**20:.1f} / {self.total / 2**20:.1f} MiB "
          f"({100 * self.done / max(self.total, 1):.0f}%), {rate / 2**20:.1f} MiB/s, "
          f"ETA {time.strftime('%H:%M:%S', time.gmtime(eta))}",
          file=self.stream,
          flush=True,
      )


class TokenFile:
  """One output at ``path`` (in the run's staging directory) and its record, ``path.json``."""

  def __init__(self, path: str, dtype: str, about: dict):
    self.path, self.dtype, self.about = path, dtype, about
    self.file = open(path, "wb")
    self.tokens = self.documents = self.text_bytes = self.max_token = 0

  def write(self, ids: np.ndarray, documents: int, text_bytes: int) -> None:
    ids.astype(self.dtype).tofile(self.file)
    self.tokens += len(ids)
    self.max_token = max(self.max_token, int(ids.max(initial=0)))
    self.documents += documents
    self.text_bytes += text_bytes

  def record(self) -> dict:
    """What the trainer reads beside the file (``sources.sidecar``)."""
    counts = dict(tokens=self.tokens, documents=self.documents, text_bytes=self.text_bytes)
    return {"dtype": self.dtype, **counts, "max_token": self.max_token, **self.about}

  def write_record(self) -> None:
    """Writes the record, once the file is complete."""
    with open(self.path + ".json", "w") as f:
      json.dump(self.record(), f, indent=1)


def batches(pieces: Iterator[documents.Piece], cut: int) -> Iterator[tuple[str, list]]:
  """(split, pieces) batches of about BATCH bytes, in order; pieces ending by input byte ``cut``
  are "train", the rest "val" (a splittable piece across it is split there).

  Example: ``[s for s, _ in batches(corpus.pieces(), cut)]`` == ["train", ..., "val"].
  """
  pending, size, split = [], 0, "train"
  for piece in pieces:
    parts = [piece]
    if piece.splittable and piece.start < cut < piece.start + piece.size:
      parts = list(piece.split(cut))
    for part in parts:
      where = "train" if part.start + part.size <= cut else "val"
      if pending and (where != split or size >= BATCH):
        yield split, pending
        pending, size = [], 0
      split = where
      pending.append(part)
      size += part.size
  if pending:
    yield split, pending


_WORKER = {}  # The tokenizer and end-of-text id of this process (set by start_worker).


def start_worker(path: str | None, eot: int | None, one_thread: bool = True) -> None:
  """Loads the tokenizer once in each worker process (``one_thread``: its threads off, one core
  a process)."""
  if one_thread:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
  _WORKER.update(tok=tokenizers_lib.load(path), eot=eot)


def encode_batch(texts: list[str], ends: list[bool]) -> np.ndarray:
  """The ids of one batch, with the worker's tokenizer."""
  return tokenizers_lib.encode(_WORKER["tok"], texts, ends, _WORKER["eot"])


def encoded(work: Iterator[tuple[str, list]], workers: int, path, eot) -> Iterator[tuple]:
  """(split, pieces, ids) for each batch of ``work``, in order; at most 2 per worker in flight."""
  if workers <= 1:
    start_worker(path, eot, one_thread=False)  # In this process: the library's threads.
    for split, pieces in work:
      yield split, pieces, encode_batch([p.text for p in pieces], [p.last for p in pieces])
    return
  spawn = multiprocessing.get_context("spawn")  # No fork of a threaded process.
  with spawn.Pool(workers, initializer=start_worker, initargs=(path, eot)) as pool:
    queue = collections.deque()
    for split, pieces in work:
      texts, ends = [p.text for p in pieces], [p.last for p in pieces]
      queue.append((split, pieces, pool.apply_async(encode_batch, (texts, ends))))
      if len(queue) >= 2 * workers:
        split, pieces, ids = queue.popleft()
        yield split, pieces, ids.get()
    while queue:
      split, pieces, ids = queue.popleft()
      yield split, pieces, ids.get()


def describe(path: str | None, tok, eot: int | None, recorded: str | None) -> dict:
  """The tokenizer's part of each record: ``path``'s, named ``recorded``."""
  return {
      "vocab_size": tokenizers_lib.vocab_size(tok),
      "eot_id": eot,
      "tokenizer": recorded,
      "tokenizer_sha256": None if path is None else tokenizers_lib.sha256(path),
  }


def convert(
    corpus: documents.Corpus,
    out_dir: str,
    val_fraction: float = 0.01,
    tokenizer: str | None = None,
    *,
    vocab_size: int = 0,
    workers: int = 1,
    eot_token: str = "",
    dtype: str = "",
) -> dict:
  """Writes ``out_dir``/train.bin and val.bin with their records (``vocab_size``: and the BPE
  trained first, tokenizer.json), committed together; returns their token counts.

  Example: ``convert(Corpus.of("a.txt"), "/data/a", 0.1, "t.json")`` -> {"train": 90, "val": 9}.
  """
  make_dir(out_dir, "out_dir")
  output = committed.Output(out_dir)
  if output.note:
    print(output.note, file=sys.stderr)
  try:
    path, recorded = output_tokenizer(corpus, output, tokenizer, vocab_size)
    tok = tokenizers_lib.load(path)
    eot = tokenizers_lib.end_of_text(tok, path, eot_token)
    about = describe(path, tok, eot, recorded)
    dtype = checked_dtype(dtype, about["vocab_size"])
    counts = write_tokens(corpus, output, val_fraction, (path, tok, eot), workers, dtype, about)
    output.commit()
  finally:
    output.close()
  return counts


def output_tokenizer(corpus, output: committed.Output, given: str | None, vocab_size: int):
  """(the tokenizer to encode with, the path the records name): a BPE trained on ``corpus``
  (``vocab_size``), else ``given``; the output directory's own (an earlier run's) is copied
  into this run's, as it goes with that run's files."""
  own = os.path.join(os.path.abspath(output.out_dir), TOKENIZER)
  if vocab_size:
    return train_tokenizer(corpus, output.path(TOKENIZER), vocab_size), own
  if given and os.path.isfile(given) and os.path.realpath(given) == os.path.realpath(own):
    shutil.copyfile(given, output.path(TOKENIZER))
    return output.path(TOKENIZER), own
  return given, given and os.path.abspath(given)


def write_tokens(corpus, output, val_fraction, tokenizer, workers, dtype, about) -> dict:
  """Encodes ``corpus`` into ``output``'s train.bin and val.bin and their records; their
  token counts. ``tokenizer``: (path, loaded or None for bytes, end-of-text id)."""
  path, tok, eot = tokenizer
  files = {s: TokenFile(output.path(f"{s}.bin"), dtype, about) for s in SPLITS}
  progress = Progress(corpus.size)
  cut = corpus.size - round(corpus.size * val_fraction)
  work = batches(corpus.pieces(), cut)
  try:
    for split, pieces, ids in encoded(work, workers if tok else 1, path, eot):
      text_bytes = sum(len(p.text.encode()) for p in pieces)
      files[split].write(ids, sum(p.last for p in pieces), text_bytes)
      progress.advance(sum(p.size for p in pieces))
  finally:
    for file in files.values():
      file.file.close()
  for file in files.values():
    file.write_record()
  return {s: f.tokens for s, f in files.items()}


def checked_dtype(dtype: str, vocab: int) -> str:
  """``dtype`` (default: the smallest for ``vocab``), once it can hold every id.

  Example: ``checked_dtype("", 50_257)`` == "uint16"; ``checked_dtype("uint8", 300)`` raises.
  """
  dtype = dtype or tokenizers_lib.dtype_for(vocab)
  if np.iinfo(dtype).max < vocab - 1:
    raise ConfigError(
        f"--dtype={dtype} cannot hold the tokenizer's {vocab} ids; use "
        f"--dtype={tokenizers_lib.dtype_for(vocab)} (or leave it out)"
    )
  return dtype


def check_outside(pattern: str, out_dir: str, corpus: documents.Corpus) -> None:
  """Raises ``ConfigError`` if ``out_dir`` lies inside the corpus (a directory ``pattern`` or
  one holding a corpus file): a later conversion would read its outputs back as text. An
  ``out_dir`` that is a file is left to :func:`make_dir`."""
  if os.path.isfile(out_dir):
    return
  out = os.path.realpath(out_dir) + os.sep
  root = os.path.realpath(os.path.expanduser(pattern))
  inside = os.path.isdir(root) and out.startswith(root + os.sep)
  if inside or any(os.path.realpath(f).startswith(out) for f in corpus.files):
    raise ConfigError(
        f"out_dir={out_dir!r} is inside the corpus {pattern!r}: a later conversion would read "
        "its outputs back as text; write them outside it"
    )


def train_tokenizer(corpus: documents.Corpus, path: str, vocab_size: int) -> str:
  """Trains a BPE of ``vocab_size`` ids on ``corpus`` into ``path``; returns ``path``."""
  began = time.monotonic()
  tokenizers_lib.train_bpe(corpus.texts(), vocab_size, path)
  print(
      f"trained a {vocab_size}-id BPE tokenizer on {corpus.size / 2**20:.1f} MiB in "
      f"{time.monotonic() - began:.0f} s",
      file=sys.stderr,
  )
  return path


def make_dir(path: str, what: str) -> None:
  """Creates directory ``path`` (and its parents); a ``ConfigError`` naming ``what`` if it can't.

  Example:
    >>> make_dir(__file__, "out_dir")
    Traceback (most recent call last):
    ...
    bv_sharding.errors.ConfigError: out_dir='.../convert.py' cannot be made a directory: ...
  """
  try:
    os.makedirs(path, exist_ok=True)
  except OSError as e:
    raise ConfigError(
        f"{what}={path!r} cannot be made a directory: {e.strerror}; name a new or existing "
        "directory you may write to"
    ) from None


@cli.command
def main(argv=None) -> None:
  """``python -m trainers.convert CORPUS OUT_DIR``: writes the token files, prints how to train."""
  parser = cli.Parser("python -m trainers.convert", __doc__)
  parser.add_argument("text", help="text files (a file, a glob or a directory), JSONL or Parquet")
  parser.add_argument("out_dir", help="where train.bin, val.bin and their .json go")
  parser.add_argument("--val_fraction", type=cli.open_fraction, default=0.01)
  parser.add_argument("--tokenizer", help="a Hugging Face tokenizer.json (default: bytes)")
  parser.add_argument(
      "--train_tokenizer", action="store_true", help="train a BPE on the corpus first"
  )
  parser.add_argument(
      "--vocab_size",
      type=cli.at_least(1, MAX_VOCAB, ", more ids than a BPE needs (the largest in use: 262144)"),
      help="the trained tokenizer's ids",
  )
  parser.add_argument("--eot_token", default="", help="the end-of-text token (default: found)")
  parser.add_argument("--text_field", default="text", help="JSONL/Parquet: the text's field")
  parser.add_argument(
      "--separator", default="", help="text files: documents end at this string (\\n: newline)"
  )
  parser.add_argument("--workers", type=cli.at_least(1), default=os.cpu_count() or 1)
  parser.add_argument("--dtype", default="", choices=("", *sources.TOKEN_DTYPES))
  args = parser.parse_args(argv)
  if args.train_tokenizer and (args.tokenizer or not args.vocab_size):
    raise ConfigError(
        "--train_tokenizer needs --vocab_size=N and no --tokenizer; e.g. --vocab_size=8192"
    )
  separator = args.separator.replace("\\n", "\n")
  corpus = documents.Corpus.of(args.text, args.text_field, separator)
  check_outside(args.text, args.out_dir, corpus)
  counts = convert(
      corpus,
      args.out_dir,
      args.val_fraction,
      args.tokenizer,
      vocab_size=args.vocab_size if args.train_tokenizer else 0,
      workers=args.workers,
      eot_token=args.eot_token,
      dtype=args.dtype,
  )
  if corpus.skipped:
    names = ", ".join(corpus.skipped[:3]) + (", ..." if len(corpus.skipped) > 3 else "")
    print(f"skipped {len(corpus.skipped)} files that are not UTF-8 text: {names}", file=sys.stderr)
  record = sources.sidecar(os.path.join(args.out_dir, "train.bin"))
  print(
      f"wrote {counts['train']} train and {counts['val']} val tokens ({record['dtype']}, vocab "
      f"{record['vocab_size']}, {record['documents']} documents in train) to {args.out_dir}; "
      f"train with --config configs/lm_data.py:train={args.out_dir}/train.bin,"
      f"val={args.out_dir}/val.bin"
  )


if __name__ == "__main__":
  main()
