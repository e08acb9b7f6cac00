"""Converts a text corpus once into byte-level token files: train.bin, val.bin and their records.

  python -m trainers.convert ~/my_text /data/my_text                  # a directory, recursively
  python -m trainers.convert '/corpus/**/*.txt' /data/txt --val_fraction=0.01 --dtype=uint16

The files (sorted) are streamed in 16 MiB chunks, never held whole; the first
1 - val_fraction of the bytes go to train.bin, the rest to val.bin. Each output
gets ``<name>.json`` with its dtype, token count and largest token id, so the
trainer checks the vocabulary without scanning. Progress goes to stderr. A bad input (a
path that names no file, an ``out_dir`` that cannot be made, a fraction outside [0, 1]) ends
as one line, ``ConfigError: ...``, with exit status 1 (``--debug``: the traceback).

Example:
  >>> import os, tempfile
  >>> corpus, out = tempfile.mkdtemp(), tempfile.mkdtemp()
  >>> with open(os.path.join(corpus, "a.txt"), "w") as f:
  ...   _ = f.write("hello world " * 10)
  >>> convert(sources.find_files(corpus, "text"), out, val_fraction=0.1)
  {'train': 108, 'val': 12}
  >>> sources.sidecar(os.path.join(out, "val.bin"))["max_token"] == ord("w")
  True
"""

import json
import os
import sys
import time
from collections.abc import Iterator

import numpy as np

from trainers import cli
from trainers.errors import ConfigError
from trainers.input import sources

CHUNK = 16 * 2**20


def chunks(files: list[str]) -> Iterator[bytes]:
  """The bytes of ``files``, one after the other, CHUNK at a time.

  Example: ``b"".join(chunks(["a.txt", "b.txt"]))``.
  """
  for path in files:
    with open(path, "rb") as f:
      while chunk := f.read(CHUNK):
        yield chunk


class Progress:
  """Prints ``done / total`` bytes and the rate to ``stream``, at most once a second."""

  def __init__(self, total: int, stream=None):
    self.total, self.stream, self.done = total, stream or sys.stderr, 0
    self.start = self.last = time.monotonic()

  def advance(self, n: int) -> None:
    self.done += n
    now = time.monotonic()
    if now - self.last >= 1 or self.done == self.total:
      self.last = now
      rate = self.done / max(now - self.start, 1e-9) / 2**20
      percent = 100 * self.done / max(self.total, 1)
      print(
          f"converted {self.done / 2**20:.1f} / {self.total / 2**20:.1f} MiB "
          f"({percent:.0f}%), {rate:.0f} MiB/s",
          file=self.stream,
          flush=True,
      )


def write_tokens(stream: Iterator[np.ndarray], path: str, dtype: str) -> int:
  """Writes the token chunks of ``stream`` to ``path`` and its ``.json`` record; returns the count.

  Example: ``write_tokens(iter([np.arange(5)]), "/tmp/t.bin", "uint16")`` == 5.
  """
  count, largest = 0, 0
  with open(path, "wb") as f:
    for tokens in stream:
      tokens.astype(dtype).tofile(f)
      count += len(tokens)
      largest = max(largest, int(tokens.max(initial=0)))
  with open(path + ".json", "w") as f:
    json.dump({"dtype": dtype, "tokens": count, "max_token": largest}, f)
  return count


def split_bytes(files: list[str], cut: int, progress: Progress) -> tuple[Iterator, Iterator]:
  """Two iterators of uint8 chunks: the first ``cut`` bytes of ``files``, then the rest.

  The first must be used up before the second is started.
  """
  source = chunks(files)
  pending = []

  def head():
    left = cut
    for chunk in source:
      progress.advance(len(chunk))
      tokens = np.frombuffer(chunk, np.uint8)
      if len(tokens) >= left:
        pending.append(tokens[left:])
        yield tokens[:left]
        return
      left -= len(tokens)
      yield tokens

  def tail():
    yield from pending
    for chunk in source:
      progress.advance(len(chunk))
      yield np.frombuffer(chunk, np.uint8)

  return head(), tail()


def convert(files: list[str], out_dir: str, val_fraction: float = 0.01, dtype: str = "uint8"):
  """Writes ``out_dir``/train.bin and val.bin (byte tokens of ``files``); returns their counts.

  Example: ``convert(["a.txt"], "/data/a", val_fraction=0.1)`` -> {"train": 90, "val": 10}.
  """
  total = sum(os.path.getsize(f) for f in files)
  make_dir(out_dir, "out_dir")
  progress = Progress(total)
  train, val = split_bytes(files, total - round(total * val_fraction), progress)
  return {
      "train": write_tokens(train, os.path.join(out_dir, "train.bin"), dtype),
      "val": write_tokens(val, os.path.join(out_dir, "val.bin"), dtype),
  }


def make_dir(path: str, what: str) -> None:
  """Creates directory ``path`` (and its parents); a ``ConfigError`` naming ``what`` if it can't.

  Example:
    >>> make_dir(__file__, "out_dir")
    Traceback (most recent call last):
    ...
    trainers.errors.ConfigError: out_dir='.../convert.py' cannot be made a directory: ...
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
  """``python -m trainers.convert TEXT OUT_DIR``: writes the token files, prints how to train."""
  parser = cli.Parser("python -m trainers.convert", __doc__)
  parser.add_argument("text", help="a UTF-8 text file, a glob or a directory (recursive)")
  parser.add_argument("out_dir", help="where train.bin, val.bin and their .json go")
  parser.add_argument("--val_fraction", type=cli.fraction, default=0.01)
  parser.add_argument("--dtype", default="uint8", choices=sources.TOKEN_DTYPES)
  args = parser.parse_args(argv)
  counts = convert(
      sources.find_files(args.text, "the text argument"),
      args.out_dir,
      args.val_fraction,
      args.dtype,
  )
  print(
      f"wrote {counts['train']} train and {counts['val']} val tokens ({args.dtype}) to "
      f"{args.out_dir}; train with --config configs/lm_data.py:train={args.out_dir}/train.bin,"
      f"val={args.out_dir}/val.bin,dtype={args.dtype}"
  )


if __name__ == "__main__":
  main()
