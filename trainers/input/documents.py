"""The documents of a corpus, streamed: text files, JSONL and Parquet, as pieces of text.

A corpus is a file, a glob or a directory (searched recursively; the ``.json`` records
beside token files are left out). Each file's format comes from its name: ``.jsonl``
(one JSON object a line), ``.parquet`` (``pyarrow``: ``pip install -e ".[parquet]"``),
anything else is a text file. A text file is one document, or, with a ``separator`` (e.g.
``<|endoftext|>``, as TinyStories' files have), one document per stretch between
separators (the separators dropped, blank stretches skipped); a JSONL line or a Parquet row
is one document, its ``text_field`` (default "text") the text.

Documents stream as :class:`Piece`s of at most about :data:`CHUNK` bytes: a longer text
file is cut after a newline (else at a character boundary), so memory stays bounded; only
a document's last piece has ``last`` set. Each piece carries its place in the input
(``start``, ``size``: bytes of the files), which is how ``trainers.convert`` splits
train from val and measures progress.

Inside a directory or glob, files that are not UTF-8 text (compiled or binary files: a
decoding error or a NUL byte in their first chunk) are skipped and counted in
``Corpus.skipped``; a file named explicitly that is not UTF-8, a JSONL line that is not
JSON or lacks the field, a Parquet file without the column, and a corpus with no text
are each a ``ConfigError`` naming the file and the fix.

Example:
  >>> import os, tempfile
  >>> folder = tempfile.mkdtemp()
  >>> with open(os.path.join(folder, "a.txt"), "w") as f:
  ...   _ = f.write("first document")
  >>> with open(os.path.join(folder, "b.jsonl"), "w") as f:
  ...   _ = f.write('{"text": "second"}\\n{"text": "third"}\\n')
  >>> corpus = Corpus.of(folder)
  >>> [(p.text, p.last) for p in corpus.pieces()]
  [('first document', True), ('second', True), ('third', True)]
"""

import dataclasses
import json
import os
from collections.abc import Iterator

from trainers.errors import ConfigError
from trainers.input import sources

CHUNK = 16 * 2**20
FORMATS = {".jsonl": "jsonl", ".parquet": "parquet"}  # Else "text".
PARQUET_ROWS = 1024  # Rows read from a Parquet file at a time.


@dataclasses.dataclass(frozen=True)
class Piece:
  """Text of one document (all of it, or a part); ``start``/``size``: its input bytes.

  ``splittable``: the piece's input bytes are its text's (a text file's), so it may be cut
  at any character boundary (:meth:`split`).
  """

  text: str
  last: bool
  start: int
  size: int
  splittable: bool = False

  def split(self, at: int) -> tuple["Piece", "Piece"]:
    """(the bytes before input position ``at``, the rest), cut at a character boundary.

    Example: ``Piece("abcd", True, 10, 4, True).split(12)`` -> pieces "ab" and "cd".
    """
    data = self.text.encode()
    cut = at - self.start
    while 0 < cut < len(data) and (data[cut] & 0xC0) == 0x80:
      cut -= 1
    head, tail = data[:cut].decode(), data[cut:].decode()
    return (
        Piece(head, False, self.start, cut, True),
        Piece(tail, self.last, self.start + cut, len(data) - cut, True),
    )


def format_of(path: str) -> str:
  """ "jsonl", "parquet" or "text", by ``path``'s extension.

  Example: ``format_of("/data/shard-0.parquet")`` == "parquet".
  """
  return FORMATS.get(os.path.splitext(path)[1].lower(), "text")


def is_text(head: bytes) -> bool:
  """Whether ``head`` (a file's first bytes) reads as UTF-8 text: it decodes and has no NUL.

  A character cut at the end of ``head`` does not count against it.

  Example: ``is_text(b"caf\\xc3")`` is True; ``is_text(b"\\x7fELF\\x00")`` is False.
  """
  if b"\0" in head:
    return False
  try:
    head.decode()
  except UnicodeDecodeError as e:
    return e.start >= len(head) - 3 and e.reason == "unexpected end of data"
  return True


def cut_point(chunk: bytes) -> int:
  """Where to end a piece of ``chunk``: after its last newline, else at a character boundary.

  Example: ``cut_point(b"ab\\ncd")`` == 3.
  """
  newline = chunk.rfind(b"\n")
  if newline >= 0:
    return newline + 1
  last = len(chunk) - 1  # The start of the last character: cut before it.
  while last > 0 and (chunk[last] & 0xC0) == 0x80:
    last -= 1
  return last or len(chunk)


@dataclasses.dataclass(frozen=True)
class Corpus:
  """The files of a corpus, how many bytes they hold, and the non-text ones skipped."""

  files: tuple[str, ...]
  size: int
  skipped: tuple[str, ...]
  text_field: str = "text"
  separator: str = ""

  @classmethod
  def of(cls, pattern: str, text_field: str = "text", separator: str = "") -> "Corpus":
    """The corpus ``pattern`` names (a file, a glob or a directory), non-text files left out."""
    files = sources.find_files(pattern, "the corpus argument")
    explicit = len(files) == 1 and os.path.isfile(os.path.expanduser(pattern))
    kept, skipped = [], []
    for path in files:
      text = format_of(path) != "text" or _head_is_text(path)
      if not text and explicit:
        raise ConfigError(
            f"{path} is not UTF-8 text; convert it to UTF-8 (e.g. iconv -t UTF-8) or name a "
            "text, .jsonl or .parquet file"
        )
      (kept if text else skipped).append(path)
    if not kept:
      raise ConfigError(
          f"the corpus {pattern!r} has no UTF-8 text files ({len(skipped)} skipped as not text); "
          "point it at text, .jsonl or .parquet files"
      )
    size = sum(os.path.getsize(f) for f in kept)
    return cls(tuple(kept), size, tuple(skipped), text_field, separator)

  def pieces(self) -> Iterator[Piece]:
    """Every document's pieces, file by file in sorted order."""
    start, texts = 0, 0
    for path in self.files:
      read = {"text": _text_pieces, "jsonl": _jsonl_pieces, "parquet": _parquet_pieces}
      for piece in read[format_of(path)](path, start, self):
        texts += bool(piece.text)
        yield piece
      start += os.path.getsize(path)
    if not texts:
      raise ConfigError(
          f"the corpus ({len(self.files)} files) holds no text; point it at non-empty files"
      )

  def texts(self) -> Iterator[str]:
    """Each piece's text: what a tokenizer is trained on."""
    return (piece.text for piece in self.pieces())


def _head_is_text(path: str) -> bool:
  with open(path, "rb") as f:
    return is_text(f.read(CHUNK))


def _text_pieces(path: str, start: int, corpus: Corpus) -> Iterator[Piece]:
  """A text file as one document (or one per separated stretch), in pieces of at most CHUNK
  bytes."""
  pieces = _file_pieces(path, start)
  return split_on(pieces, corpus.separator) if corpus.separator else pieces


def split_on(pieces: Iterator[Piece], separator: str) -> Iterator[Piece]:
  """One file's ``pieces`` (one document) re-cut into a document per stretch between
  ``separator``s; blank stretches are skipped, their bytes counted with the next piece.

  Example:
    >>> one = iter([Piece("a<s>b<", False, 0, 6, True), Piece("s><s>c", True, 6, 6, True)])
    >>> [(p.text, p.last, p.start, p.size) for p in split_on(one, "<s>")]
    [('a', True, 0, 4), ('b', True, 4, 4), ('c', True, 8, 4)]
  """
  carry, width = "", len(separator.encode())
  offset = position = None  # Where carry begins; the first byte not in a piece yielded.
  for piece in pieces:
    if offset is None:
      offset = position = piece.start
    *done, carry = (carry + piece.text).split(separator)
    for text in done:
      end = offset + len(text.encode()) + width  # Through its separator.
      if text.strip():
        yield Piece(text, True, position, end - position, True)
        position = end
      offset = end
    if len(carry) > CHUNK and not piece.last:  # A long document: all but a possible separator.
      head, carry = carry[: -len(separator)], carry[-len(separator) :]
      offset += len(head.encode())
      yield Piece(head, False, position, offset - position, True)
      position = offset
  if carry.strip():
    yield Piece(carry, True, position, offset + len(carry.encode()) - position, True)


def _file_pieces(path: str, start: int) -> Iterator[Piece]:
  """A text file's bytes as one document, in pieces of at most CHUNK bytes."""
  with open(path, "rb") as f:
    data = f.read(CHUNK)
    while data:
      more = f.read(CHUNK)
      cut = len(data) if not more else cut_point(data) or len(data)
      head, data = data[:cut], data[cut:] + more
      try:
        text = head.decode()
      except UnicodeDecodeError as e:
        raise ConfigError(
            f"{path} is not UTF-8 at byte {start + e.start}; convert it to UTF-8 or remove it"
        ) from None
      yield Piece(text, not data, start, len(head), True)
      start += len(head)


def _jsonl_pieces(path: str, start: int, corpus: Corpus) -> Iterator[Piece]:
  """A JSONL file's lines, each one document: its ``corpus.text_field``."""
  field = corpus.text_field
  with open(path, "rb") as f:
    for number, line in enumerate(f, 1):
      if line.strip():
        yield Piece(_field(path, number, line, field), True, start, len(line))
      start += len(line)


def _field(path: str, number: int, line: bytes, field: str) -> str:
  try:
    record = json.loads(line)
  except ValueError:
    raise ConfigError(
        f"{path}:{number} is not a JSON object (or not UTF-8); write one JSON object a line"
    ) from None
  if not isinstance(record, dict) or not isinstance(record.get(field), str):
    keys = sorted(record) if isinstance(record, dict) else []
    raise ConfigError(
        f"{path}:{number} has no text field {field!r} (its keys: {keys}); name the field "
        "with --text_field"
    )
  return record[field]


def _parquet_pieces(path: str, start: int, corpus: Corpus) -> Iterator[Piece]:
  """A Parquet file's rows, each one document: column ``corpus.text_field``, PARQUET_ROWS rows
  at a time."""
  field = corpus.text_field
  try:
    import pyarrow as pa  # pylint: disable=g-import-not-at-top
    from pyarrow import parquet  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise ConfigError(
        f"{path} is Parquet, which needs pyarrow: pip install -e '.[parquet]'"
    ) from None
  try:
    table = parquet.ParquetFile(path)
  except Exception as e:  # pyarrow's errors (ArrowInvalid, OSError) for a file it cannot read.
    raise ConfigError(f"{path} cannot be read as Parquet ({e}); name a .parquet file") from None
  names = table.schema_arrow.names
  if field not in names:
    raise ConfigError(
        f"{path} has no column {field!r} (its columns: {names}); name it with --text_field"
    )
  kind = table.schema_arrow.field(field).type
  if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
    raise ConfigError(
        f"{path}: column {field!r} holds {kind}, not text; name a string column with --text_field"
    )
  rows, size = max(table.metadata.num_rows, 1), os.path.getsize(path)
  done = 0
  for batch in table.iter_batches(batch_size=PARQUET_ROWS, columns=[field]):
    for text in batch.column(0).to_pylist():
      # Each row's share of the file's bytes, for progress and the train/val cut.
      offset, done = done * size // rows, done + 1
      yield Piece(text or "", True, start + offset, done * size // rows - offset)
