"""The tokenizer of a corpus: bytes (the default), a Hugging Face ``tokenizer.json``, or one trained.

``trainers.convert`` encodes with it and records which one it was beside each token file;
``trainers.sample`` decodes with the same one. ``None`` stands for the byte-level tokenizer:
ids are the UTF-8 bytes (vocab 256, no end-of-text id). A ``tokenizer.json`` is read with the
``tokenizers`` library; its end-of-text id is the first of :data:`EOT_NAMES` it holds (or
the token named by ``--eot_token``). :func:`train_bpe` trains a byte-level BPE (GPT-2's
scheme) whose end-of-text token is ``<|endoftext|>``.

Example:
  >>> import os, tempfile
  >>> path = os.path.join(tempfile.mkdtemp(), "tokenizer.json")
  >>> tok = train_bpe(iter(["hello world", "hello there"] * 50), 300, path)
  >>> eot = end_of_text(tok, path)
  >>> ids = encode(tok, ["hello world"], [True], eot)
  >>> int(ids[-1]) == eot, decode(tok, ids[:-1])
  (True, 'hello world')
  >>> encode(None, ["hé"], [True], None).tolist(), decode(None, [104, 195, 169])  # bytes
  ([104, 195, 169], 'hé')
"""

import hashlib

import numpy as np

EOT = "<|endoftext|>"
# End-of-text tokens of common tokenizers, in the order they are looked for.
EOT_NAMES = (EOT, "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>", "[SEP]")
BYTE_VOCAB = 256


def _error(message: str):
  from trainers.errors import ConfigError  # Here: worker processes import this module only.

  return ConfigError(message)


def load(path: str | None):
  """The ``tokenizers.Tokenizer`` in ``path`` (None: bytes); a ``ConfigError`` if unreadable.

  Example: ``load("/data/gpt2/tokenizer.json").get_vocab_size()``.
  """
  if path is None:
    return None
  import tokenizers  # pylint: disable=g-import-not-at-top

  try:
    return tokenizers.Tokenizer.from_file(path)
  except Exception as e:  # The library raises plain Exceptions for any unreadable file.
    raise _error(
        f"--tokenizer={path} cannot be read as a Hugging Face tokenizer.json ({str(e)[:120]}); "
        "name the tokenizer.json of a tokenizers/transformers tokenizer"
    ) from None


def train_bpe(texts, vocab_size: int, path: str):
  """A byte-level BPE of ``vocab_size`` ids trained on the strings ``texts``, saved to ``path``.

  Example: ``train_bpe(documents, 32_000, "/data/my_text/tokenizer.json")``.
  """
  import tokenizers  # pylint: disable=g-import-not-at-top
  from tokenizers import decoders, models, pre_tokenizers, trainers

  if vocab_size <= BYTE_VOCAB:
    raise _error(f"--vocab_size={vocab_size} must be above {BYTE_VOCAB} (the byte alphabet)")
  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
      vocab_size=vocab_size,
      special_tokens=[EOT],
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
      show_progress=False,
  )
  tok.train_from_iterator(texts, trainer)
  tok.save(path)
  return tok


def end_of_text(tok, path: str | None, name: str = "") -> int | None:
  """``tok``'s end-of-text id: token ``name``, else the first of EOT_NAMES it has (bytes: None).

  Example: ``end_of_text(load("gpt2/tokenizer.json"), "gpt2/tokenizer.json")`` == 50256.
  """
  if tok is None:
    return None
  for candidate in (name,) if name else EOT_NAMES:
    if (found := tok.token_to_id(candidate)) is not None:
      return found
  wanted = repr(name) if name else f"any of {list(EOT_NAMES)}"
  raise _error(
      f"--tokenizer={path} has no token {wanted}; name its end-of-text token with --eot_token"
  )


def vocab_size(tok) -> int:
  """The number of ids ``tok`` can produce (its added tokens included; bytes: 256)."""
  return BYTE_VOCAB if tok is None else tok.get_vocab_size(with_added_tokens=True)


def sha256(path: str) -> str:
  """The hex SHA-256 of file ``path``: which tokenizer a record's token files were made with."""
  with open(path, "rb") as f:
    return hashlib.file_digest(f, "sha256").hexdigest()


def dtype_for(vocab: int) -> str:
  """The smallest token dtype of ``vocab`` ids: uint8 for bytes, uint16 up to 65,536, else uint32.

  Example: ``dtype_for(50_257)`` == "uint16".
  """
  return "uint8" if vocab <= BYTE_VOCAB else "uint16" if vocab <= 2**16 else "uint32"


def encode(tok, texts: list[str], ends: list[bool], eot: int | None) -> np.ndarray:
  """The ids of ``texts`` in order, ``eot`` after each text whose ``ends`` is True (int64).

  Example: ``encode(None, ["ab"], [True], None)`` -> array([97, 98]).
  """
  if tok is None:
    pieces = [np.frombuffer(t.encode(), np.uint8).astype(np.int64) for t in texts]
  else:
    pieces = [np.asarray(e.ids, np.int64) for e in tok.encode_batch_fast(texts)]
  if eot is not None:
    tail = np.array([eot], np.int64)
    pieces = [p for piece, end in zip(pieces, ends) for p in ((piece, tail) if end else (piece,))]
  return np.concatenate(pieces) if pieces else np.zeros(0, np.int64)


def decode(tok, ids) -> str:
  """The text of ``ids`` (bytes: UTF-8, an incomplete character as U+FFFD).

  Example: ``decode(None, [104, 105])`` == "hi".
  """
  if tok is None:
    return bytes(int(i) for i in ids).decode(errors="replace")
  return tok.decode([int(i) for i in ids], skip_special_tokens=False)
