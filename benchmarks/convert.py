"""How fast does ``trainers.convert`` turn text into tokens? MB/s of text, beside the library's own.

  python -m benchmarks.convert [--mib 32] [--vocab_size 8192] [--rounds 2]

Writes a corpus of ``--mib`` MiB here (documents of 2-64 KiB of Zipf-distributed pseudo-words,
one text file each), trains a BPE of ``--vocab_size`` ids on its first 4 MiB, then times, best
of ``--rounds``, in MB/s (10^6 bytes) of text:
  tokenizers encode_batch       the library's single call on every document held in memory
                                (its own threads: every core), nothing written;
  tokenizers encode_batch_fast  the same without offsets (what the converter's workers call);
  trainers.convert, N workers   the whole command's work: read, encode in N processes, write
                                train.bin/val.bin and records (1 and every core);
  trainers.convert, bytes       the byte-level default (no tokenizer).
"""

import os
import sys
import tempfile
import time

import numpy as np

from trainers import convert
from trainers.input import documents
from trainers.input import tokenizer as tokenizers_lib
from trainers.settings import cli

TRAIN_SAMPLE = 4 * 2**20


def write_corpus(folder: str, mib: int, seed: int = 0) -> list[str]:
  """``mib`` MiB of documents as text files in ``folder``; returns their texts."""
  rng = np.random.default_rng(seed)
  letters = np.array(list("etaoinshrdlucmfwypvbgkqjxz"))
  words = ["".join(rng.choice(letters, rng.integers(1, 10))) for _ in range(20_000)]
  weights = 1 / np.arange(1, len(words) + 1)
  texts, size = [], 0
  while size < mib * 2**20:
    n = int(rng.integers(300, 10_000))
    text = " ".join(np.array(words)[rng.choice(len(words), n, p=weights / weights.sum())])
    texts.append(text + ".\n")
    size += len(texts[-1])
  for i, text in enumerate(texts):
    with open(os.path.join(folder, f"{i:06}.txt"), "w") as f:
      f.write(text)
  return texts


def best_seconds(fn, rounds: int) -> float:
  """The least wall time of ``rounds`` calls of ``fn``."""
  best = float("inf")
  for _ in range(rounds):
    start = time.perf_counter()
    fn()
    best = min(best, time.perf_counter() - start)
  return best


@cli.command
def main(argv=None):
  parser = cli.Parser("python -m benchmarks.convert", __doc__)
  parser.add_argument("--mib", type=cli.at_least(1), default=32)
  parser.add_argument("--vocab_size", type=cli.at_least(257), default=8192)
  parser.add_argument("--rounds", type=cli.at_least(1), default=2)
  args = parser.parse_args(argv)
  tmp = tempfile.TemporaryDirectory()
  folder = os.path.join(tmp.name, "corpus")
  os.makedirs(folder)
  texts = write_corpus(folder, args.mib)
  size = sum(len(t.encode()) for t in texts)
  sample, taken = [], 0
  for text in texts:
    sample, taken = sample + [text], taken + len(text)
    if taken >= TRAIN_SAMPLE:
      break
  path = os.path.join(tmp.name, "tokenizer.json")
  tok = tokenizers_lib.train_bpe(iter(sample), args.vocab_size, path)
  corpus = documents.Corpus.of(folder)
  cores = os.cpu_count() or 1
  quiet = open(os.devnull, "w")
  out = os.path.join(tmp.name, "out")

  def run_convert(tokenizer, workers):
    stderr, sys.stderr = sys.stderr, quiet  # No progress lines in the table.
    try:
      convert.convert(corpus, out, 0.01, tokenizer, workers=workers)
    finally:
      sys.stderr = stderr

  rows = {
      "tokenizers encode_batch (one call, its threads)": lambda: tok.encode_batch(texts),
      "tokenizers encode_batch_fast (one call, its threads)": lambda: tok.encode_batch_fast(texts),
      "trainers.convert, 1 worker": lambda: run_convert(path, 1),
      f"trainers.convert, {cores} workers": lambda: run_convert(path, cores),
      "trainers.convert, bytes (no tokenizer)": lambda: run_convert(None, 1),
  }
  print(
      f"{size / 1e6:.1f} MB of text in {len(texts)} documents, BPE of {args.vocab_size} ids, "
      f"{cores} cores; best of {args.rounds}\n"
  )
  print("| what | MB/s of text |")
  print("|---|---|")
  for name, fn in rows.items():
    print(f"| {name} | {size / 1e6 / best_seconds(fn, args.rounds):.2f} |", flush=True)
  tmp.cleanup()


if __name__ == "__main__":
  main()
