"""TensorBoard event files beside ``metrics.jsonl``: one scalar per number of each record.

``tensorboard --logdir runs/`` then shows every run's curves. The writer is tensorboardX
(no TensorFlow); its file is opened at the first record, so a resuming run can first move an
earlier attempt's ``tensorboard/`` aside (``workdir.keep_metrics_until``) and replay the
records it keeps. Records are flushed as written: a killed run loses none. In a ``gs://``
workdir the event file goes through ``etils.epath``, written whole at each flush.

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

import io
import math
import os
import struct

from etils import epath

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
    self.writer = None

  def write(self, record: dict) -> None:
    """Adds one scalar per number of ``record`` at ``record["step"]`` and flushes.

    Example: ``EventWriter(workdir).write({"step": 10, "loss": 2.3})``.
    """
    if self.writer is None:
      from tensorboardX import SummaryWriter, record_writer

      record_writer.register_writer_factory("gs", _WholeObjects())  # Not tensorboardX's own.
      self.writer = SummaryWriter(self.directory)
    for key, value in scalars(record).items():
      self.writer.add_scalar(key, value, record["step"])
    self.writer.flush()

  def close(self) -> None:
    """Closes the event file (if one was opened)."""
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


class _WholeObjects:
  """tensorboardX's writer factory for ``gs://`` event files through ``etils.epath``: the file
  is kept here and written whole at each flush (one object write: no append in a bucket)."""

  def open(self, path: str):
    return _WholeObject(path)

  def directory_check(self, path: str) -> None:
    del path  # A bucket has no directories to create.


class _WholeObject:
  """An event file written whole, as one object, at each ``flush`` and at ``close``."""

  def __init__(self, path: str):
    self.target, self.data = epath.Path(path), io.BytesIO()

  def write(self, data: bytes) -> None:
    self.data.write(data)

  def flush(self) -> None:
    self.target.write_bytes(self.data.getvalue())

  def close(self) -> None:
    self.flush()
