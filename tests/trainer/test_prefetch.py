"""trainers/input/prefetch.py: the background thread keeps the order, the sharding and its distance."""

import threading
import time

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from trainers.input import batching, prefetch


@pytest.fixture(scope="module")
def sharding():
  return NamedSharding(jax.make_mesh((jax.device_count(),), ("data",)), P("data"))


def local_batches(count, pulled=None):
  for step in range(count):
    if pulled is not None:
      pulled.append(step)
    yield {"x": np.full((16, 3), step, np.int32), "y": np.arange(16) + step}


def test_batches_arrive_in_order_on_the_batch_sharding(sharding):
  got = list(prefetch.to_device(local_batches(5), sharding, depth=2))
  assert len(got) == 5
  for step, (batch, local) in enumerate(zip(got, local_batches(5))):
    assert batch["x"].sharding == sharding and batch["x"].shape == (16, 3)
    expected = batching.to_global(local, sharding)
    for key in local:
      np.testing.assert_array_equal(np.asarray(batch[key]), np.asarray(expected[key]))
    assert np.asarray(batch["x"])[0, 0] == step


def test_the_thread_runs_at_most_depth_steps_ahead_and_stops(sharding):
  pulled = []
  batches = prefetch.to_device(local_batches(100, pulled), sharding, depth=2)
  next(batches)
  time.sleep(0.5)  # Ample time to run ahead, were it unbounded.
  assert 3 <= len(pulled) <= 4  # The one taken, `depth` queued, one waiting to be queued.
  batches.close()
  assert not any(t.name == "prefetch" for t in threading.enumerate())


def test_an_error_in_the_reader_reaches_the_train_loop(sharding):
  def broken():
    yield from local_batches(1)
    raise OSError("disk gone")

  batches = prefetch.to_device(broken(), sharding)
  next(batches)
  with pytest.raises(OSError, match="disk gone"):
    next(batches)
