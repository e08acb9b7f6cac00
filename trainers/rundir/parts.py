"""A growing file in a bucket, as numbered objects written in the background.

An object store has no append: rewriting a growing file whole at each record writes O(records²)
bytes, and waits on the network each time. :class:`Parts` takes each chunk of bytes from the
caller at once (a queue) and a thread writes what is queued as the next object,
``directory/pattern.format(n)`` with n = 1, 2, ... after the highest already there: each byte is
sent once, in the order put, and the caller waits only in :meth:`close` (or when ``limit``
chunks are pending). :meth:`until_written` returns a wait for the chunks put so far, which
another thread may call (the trainer's checkpoint saves do, so a checkpoint follows its
records without the loop waiting). A failed write's error is raised to the caller at each later
call. Readers take the parts in order of n (:func:`part_names`).

Example:
  >>> import os, tempfile
  >>> from etils import epath
  >>> folder = epath.Path(tempfile.mkdtemp())
  >>> log = Parts(folder, "{:08d}.jsonl")
  >>> log.put(b"one\\n")
  >>> wait = log.until_written()  # A wait for "one" only, whatever is put later.
  >>> wait()
  >>> log.put(b"two\\n")
  >>> log.close()
  >>> [(p.name, p.read_text()) for p in part_names(folder, "{:08d}.jsonl")]
  [('00000001.jsonl', 'one\\n'), ('00000002.jsonl', 'two\\n')]
"""

import queue
import threading
from collections.abc import Callable

from etils import epath

_STOP = None  # Queued by close: the thread ends.


def each(waits: list[Callable[[], None]]) -> Callable[[], None]:
  """One wait for every wait of ``waits`` (e.g. several :meth:`Parts.until_written`), in turn."""

  def wait() -> None:
    for one in waits:
      one()

  return wait


def part_names(directory: epath.Path, pattern: str) -> list[epath.Path]:
  """The parts ``pattern`` (one ``{}`` field: the number) names in ``directory``, in order."""
  return [path for _, path in _numbered(directory, pattern)]


def _numbered(directory: epath.Path, pattern: str) -> list[tuple[int, epath.Path]]:
  head, tail = pattern.split("{", 1)[0], pattern.split("}", 1)[1]
  numbered = []
  if directory.is_dir():
    for path in directory.glob(f"{head}*{tail}"):
      number = path.name[len(head) : len(path.name) - len(tail)]
      if number.isdigit():
        numbered.append((int(number), path))
  return sorted(numbered)


class Parts:
  """Writes the chunks given to :meth:`put` as new objects ``directory/pattern.format(n)``."""

  def __init__(self, directory: epath.Path, pattern: str, limit: int = 1024):
    self.directory, self.pattern = directory, pattern
    self.queue = queue.Queue(limit)
    self.thread, self.error, self.starting = None, None, threading.Lock()
    self.put_count, self.written = 0, threading.Condition()
    self.written_count = 0  # Chunks written (or failed), in the order put.

  def put(self, data: bytes) -> None:
    """Queues ``data`` for the next object; returns at once (raises a failed write's error)."""
    self._raise()
    with self.starting:  # Callers on two threads (tensorboardX's, the loop's) start one.
      if self.thread is None:
        self.thread = threading.Thread(target=self._write, name="parts", daemon=True)
        self.thread.start()
      self.put_count += 1
      self.queue.put(data)

  def until_written(self) -> Callable[[], None]:
    """A wait, callable from any thread, until every chunk put so far is written (not those
    put later); it raises a failed write's error."""
    with self.starting:
      target = self.put_count

    def wait() -> None:
      with self.written:
        self.written.wait_for(lambda: self.written_count >= target)
      self._raise()

    return wait

  def close(self) -> None:
    """Writes what is queued, then ends the thread."""
    if self.thread is not None:
      self.queue.put(_STOP)
      self.thread.join()
      self.thread = None
    self._raise()

  def _raise(self) -> None:
    if self.error is not None:
      raise self.error

  def _write(self) -> None:
    """The thread: each time, what is queued becomes the next part."""
    n = max((n for n, _ in _numbered(self.directory, self.pattern)), default=0)
    stop = False
    while not stop:
      chunks = [self.queue.get()]
      while not self.queue.empty():
        chunks.append(self.queue.get())
      stop = _STOP in chunks
      data = b"".join(c for c in chunks if c is not _STOP)
      try:
        if data:
          n += 1
          (self.directory / self.pattern.format(n)).write_bytes(data)
      except Exception as e:  # Raised to the caller at its next call.
        self.error = e
      finally:
        with self.written:
          self.written_count += len(chunks) - stop
          self.written.notify_all()
