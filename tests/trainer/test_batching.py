"""Tests for trainers.input.batching: determinism, held-out splits, per-process slicing, resuming."""

import os
import pathlib
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

from trainers import launch
from trainers.errors import ConfigError
from trainers.input import batching, sources

REPO = pathlib.Path(__file__).resolve().parents[2]
ARRAY = (np.arange(10_000) % 251).astype(np.uint8)
STREAM = sources.TokenStream((ARRAY,), ("stream",))
IMAGES = {
    "image": np.arange(50 * 4, dtype=np.float32).reshape(50, 2, 2, 1),
    "label": np.arange(50, dtype=np.int32),
}


def _take(iterator, n):
  return [next(iterator) for _ in range(n)]


def _text(step=0, seed=0, process_index=0, process_count=1):
  """Step ``step`` of an 8 x 9 window pipeline over STREAM."""
  return next(
      batching.text_batches(
          STREAM,
          seq_len=8,
          global_batch=8,
          seed=seed,
          start_step=step,
          process_index=process_index,
          process_count=process_count,
      )
  )


def test_text_batches_are_windows_of_the_stream():
  batch = _text()
  assert batch.shape == (8, 9) and batch.dtype == np.int32
  # STREAM is arange mod 251, so every window counts up by one (mod 251).
  np.testing.assert_array_equal(np.diff(batch, axis=1) % 251, 1)


def test_batches_are_deterministic_per_step():
  it = batching.text_batches(
      STREAM, seq_len=8, global_batch=8, seed=0, process_index=0, process_count=1
  )
  steps = _take(it, 3)
  for step, batch in enumerate(steps):
    np.testing.assert_array_equal(batch, _text(step=step))  # Resumable.
  assert not np.array_equal(steps[0], steps[1])
  assert not np.array_equal(_text(seed=1), steps[0])


@pytest.mark.parametrize("process_count", [2, 4])
def test_process_slices_concatenate_to_the_global_batch(process_count):
  for step in range(3):
    local = [
        _text(step, process_index=p, process_count=process_count) for p in range(process_count)
    ]
    np.testing.assert_array_equal(np.concatenate(local), _text(step))


def test_image_process_slices_concatenate_to_the_global_batch():
  def batch(p, n):
    return next(
        batching.image_batches(IMAGES, global_batch=8, seed=3, process_index=p, process_count=n)
    )

  full = batch(0, 1)
  assert full["image"].shape == (8, 2, 2, 1)
  np.testing.assert_array_equal(full["image"][:, 0, 0, 0], full["label"] * 4)  # Rows stay paired.
  halves = [batch(p, 2) for p in range(2)]
  for key in full:
    np.testing.assert_array_equal(np.concatenate([h[key] for h in halves]), full[key])


def test_global_batch_must_divide_by_process_count():
  with pytest.raises(ConfigError, match="batch_size=6 must be a positive multiple of 4"):
    batching.text_batches(
        STREAM, seq_len=8, global_batch=6, seed=0, process_index=0, process_count=4
    )


def test_to_global_shards_rows_over_devices():
  n = jax.device_count()  # 8 under tests/conftest.py.
  mesh = jax.make_mesh((n,), ("data",))
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
  local = next(batching.image_batches(IMAGES, global_batch=2 * n, seed=0))
  batch = batching.to_global(local, sharding)
  assert batch["image"].shape == (2 * n, 2, 2, 1)
  assert len(batch["label"].addressable_shards) == n
  for shard in batch["label"].addressable_shards:
    np.testing.assert_array_equal(shard.data, local["label"][shard.index])


_WORKER = textwrap.dedent("""
    import sys
    import jax
    import numpy as np
    from trainers.input import batching, sources

    process_id, port, out, path = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    jax.config.update("jax_num_cpu_devices", 4)
    jax.distributed.initialize(f"localhost:{port}", num_processes=2,
                               process_id=process_id)
    mesh = jax.make_mesh((8,), ("data",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    spec = sources.input_spec(sources.input_config(kind="tokens", train=path, dtype="uint8"))
    train = sources.token_stream(spec, "train")  # memmapped; this process reads its rows
    local = next(batching.text_batches(train, seq_len=8, global_batch=8, seed=0,
                                   start_step=2))
    batch = batching.to_global(local, sharding)
    np.savez(out, **{str(s.index[0].start): s.data
                     for s in batch.addressable_shards})
""")


def test_two_processes_of_four_devices_build_the_one_process_batch(tmp_path):
  """Each of 2 jax.distributed processes reads its rows of a token file; together: 1 process's."""
  path = tmp_path / "train.bin"
  ARRAY.tofile(path)
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env.update(PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu")
  port = launch.free_port()
  workers = [
      subprocess.Popen(
          [sys.executable, "-c", _WORKER, str(p), str(port), tmp_path / f"{p}.npz", path],
          env=env,
          stdout=subprocess.PIPE,
          stderr=subprocess.STDOUT,
      )
      for p in range(2)
  ]
  for w in workers:
    assert w.wait(timeout=60) == 0, w.stdout.read().decode()[-2000:]
  rows = {}
  for p in range(2):
    with np.load(tmp_path / f"{p}.npz") as shards:
      rows.update({int(k): shards[k] for k in shards})
  assembled = np.concatenate([rows[i] for i in range(8)])
  np.testing.assert_array_equal(assembled, _text(step=2))
