"""TensorBoard event files beside ``metrics.jsonl``: one scalar per number of each record.

``tensorboard --logdir runs/`` then shows every run's curves. The writer is tensorboardX
(no TensorFlow); its file is opened at the first record, so a resuming run can first move an
earlier attempt's ``tensorboard/`` aside (``workdir.keep_metrics_until``) and replay the
records it keeps. Records are flushed as written: a killed run loses none. In a ``gs://``
workdir (no append) each flush's bytes become a new object through ``etils.epath``, from a
background thread (trainers/rundir/parts.py): ``events.out.tfevents.<time>.<host>.00000001``,
``...00000002``, ...; TensorBoard reads every event file of a directory, in name order.

Example:
  >>> import os, tempfile
  >>> run = tempfile.mkdtemp()
  >>> events = EventWriter(run)
  >>> os.path.exists(os.path.join(run, TENSORBOARD))  # nothing until the first record
  False
  >>> events.write({"step": 1, "loss": 2.5, "flops_source": "jaxpr", "mfu": None})
  >>> events.close()
  >>> read_scalars(os.path.join(run, TENSORBOARD))
  {'loss': [(1, 2.5)]}
"""

import math
import os
import struct
import threading
from collections.abc import Callable

from etils import epath

from trainers.rundir import parts

TENSORBOARD = "tensorboard"


def scalars(record: dict) -> dict[str, float]:
  """The record's finite numbers but its step (strings, None, NaN and bools left out).

  Example: ``scalars({"step": 3, "loss": 2.0, "mfu": None})`` == {"loss": 2.0}.
  """
  return {
      key: float(value)
      for key, value in record.items()
      if key != "step"
      and isinstance(value, int | float)
      and not isinstance(value, bool)
      and math.isfinite(value)
  }


class EventWriter:
  """Writes each metrics record into ``<workdir>/tensorboard/`` as scalars at its step."""

  def __init__(self, path: str):
    self.directory = os.path.join(path, TENSORBOARD)
    self.writer, self.objects = None, _PartFiles()

  def write(self, record: dict) -> None:
    """Adds one scalar per number of ``record`` at ``record["step"]`` and flushes.

    Example: ``EventWriter(workdir).write({"step": 10, "loss": 2.3})``.
    """
    if self.writer is None:
      from tensorboardX import SummaryWriter, record_writer

      record_writer.register_writer_factory("gs", self.objects)  # Not tensorboardX's own.
      self.writer = SummaryWriter(self.directory)
    for key, value in scalars(record).items():
      self.writer.add_scalar(key, value, record["step"])
    self.writer.flush()

  def until_written(self) -> Callable[[], None]:
    """A wait (callable from any thread) until the records written so far are in the bucket,
    not those written later (:meth:`write` hands each to its file's parts); local: none."""
    return parts.each([file.parts.until_written() for file in self.objects.opened])

  def close(self) -> None:
    """Closes the event file (if one was opened); a bucket's: once its parts are written."""
    if self.writer is not None:
      self.writer.close()
      self.writer = None


def read_scalars(directory: str) -> dict[str, list[tuple[int, float]]]:
  """Tag -> [(step, value)] of every event file in ``directory``, in file then write order.

  Example: ``read_scalars("runs/lm/tensorboard")["loss"][0]`` == (1, 5.54...).
  """
  from tensorboardX.proto import event_pb2

  found: dict[str, list[tuple[int, float]]] = {}
  for name in sorted(epath.Path(directory).glob("events.out.tfevents.*")):
    for data in _records(name):
      event = event_pb2.Event.FromString(data)
      for value in event.summary.value:
        found.setdefault(value.tag, []).append((event.step, value.simple_value))
  return found


def _records(name: str):
  """The payloads of a TFRecord file: length (8 bytes), its CRC (4), payload, its CRC (4)."""
  with epath.Path(name).open("rb") as f:
    while header := f.read(12):
      (length,) = struct.unpack("<Q", header[:8])
      yield f.read(length)
      f.read(4)


class _PartFiles:
  """tensorboardX's writer factory for ``gs://`` event files through ``etils.epath``: each
  flush's bytes a new object, written in the background (no append in a bucket)."""

  def __init__(self):
    self.opened = []

  def open(self, path: str):
    self.opened.append(_PartFile(path))
    return self.opened[-1]

  def directory_check(self, path: str) -> None:
    del path  # A bucket has no directories to create.


class _PartFile:
  """An event file as numbered objects ``<path>.00000001``, ...: one per ``flush``."""

  def __init__(self, path: str):
    target = epath.Path(path)
    self.parts, self.data = parts.Parts(target.parent, target.name + ".{:08d}"), b""
    self.lock = threading.Lock()  # tensorboardX's thread writes, flushes every 2 minutes too.

  def write(self, data: bytes) -> None:
    with self.lock:
      self.data += data

  def flush(self) -> None:
    with self.lock:
      data, self.data = self.data, b""
    if data:
      self.parts.put(data)

  def close(self) -> None:
    self.flush()
    self.parts.close()
