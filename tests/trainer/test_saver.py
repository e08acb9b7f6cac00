"""Saves off the loop: a save's write holds at most its budget of bytes in flight, in real orbax
checkpoints, uncompressed, that restore exactly (in-process, 8 CPU devices, no training)."""

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding, PartitionSpec
from orbax.checkpoint._src.serialization import limits

import bv_sharding as bvs
from trainers.rundir import checkpoint, saver

ITEMS = (checkpoint.PARAMS, checkpoint.OPT)


def test_the_write_budget_counts_each_distinct_local_shard_once():
  mesh = bvs.make_mesh([("data", 8)])
  leaf = jax.ShapeDtypeStruct((64, 1024), jnp.float32)  # 256 KiB
  sharded = jax.ShapeDtypeStruct(
      leaf.shape, leaf.dtype, sharding=NamedSharding(mesh, PartitionSpec("data"))
  )
  replicated = jax.ShapeDtypeStruct(
      leaf.shape, leaf.dtype, sharding=NamedSharding(mesh, PartitionSpec())
  )
  # Eight shards of 32 KiB, or one copy of 256 KiB held by 8 devices.
  assert saver.write_budget([sharded] * 8) == 8 * 256 * 1024 // 4
  assert saver.write_budget([replicated] * 8) == 8 * 256 * 1024 // 4
  assert saver.write_budget([sharded]) == 256 * 1024 // 4
  assert saver.write_budget([replicated]) == 256 * 1024 + 1  # More than its one shard.


def test_a_host_copy_outlives_the_donated_state_in_the_same_shardings():
  mesh = bvs.make_mesh([("data", 8)])
  sharding = NamedSharding(mesh, PartitionSpec("data"))
  x = jax.device_put(jnp.arange(64.0).reshape(8, 8), sharding)
  copy = saver.host_copy({"x": x, "n": 3})
  x.delete()  # As the next train step's donation does.
  assert copy["n"] == 3 and copy["x"].sharding == sharding
  np.testing.assert_array_equal(copy["x"], np.arange(64.0).reshape(8, 8))


@pytest.fixture
def in_flight(monkeypatch):
  """``{limit: peak bytes reserved at once}`` of every limited orbax write while it runs."""
  peaks, now = {}, {}
  wait, release = limits.LimitInFlightBytes.wait_for_bytes, limits.LimitInFlightBytes.release_bytes

  async def wait_for_bytes(self, requested):
    await wait(self, requested)
    now[self] = now.get(self, 0) + requested
    peaks[self.max_bytes] = max(peaks.get(self.max_bytes, 0), now[self])

  async def release_bytes(self, requested):
    now[self] -= requested
    await release(self, requested)

  monkeypatch.setattr(limits.LimitInFlightBytes, "wait_for_bytes", wait_for_bytes)
  monkeypatch.setattr(limits.LimitInFlightBytes, "release_bytes", release_bytes)
  return peaks


def test_a_save_holds_at_most_its_budget_in_flight_and_restores_exactly(tmp_path, in_flight):
  mesh = bvs.make_mesh([("data", 8)])
  tree = {
      item: {f"w{i}": jnp.arange(64 * 1024.0).reshape(64, 1024) + i for i in range(8)}
      for item in ITEMS
  }
  plan = bvs.plan(tree, [(".*", 'fsdp(axis="data", min_size_to_shard_mb=0)')], mesh)
  state = jax.device_put(tree, plan.shardings)
  target = plan.abstract()
  budget = {item: saver.write_budget(target[item]) for item in ITEMS}
  assert budget == {item: 8 * 256 * 1024 // 4 for item in ITEMS}
  unlimited = checkpoint.open_manager(str(tmp_path / "default"))
  checkpoint.save(unlimited, 1, saver.host_copy(state), {"step": 1}, force=True)
  unlimited.wait_until_finished()
  everything = max(in_flight.values())
  in_flight.clear()
  budgeted = checkpoint.open_manager(str(tmp_path / "budgeted"), write_bytes=budget)
  checkpoint.save(budgeted, 1, saver.host_copy(state), {"step": 1}, force=True)
  budgeted.wait_until_finished()
  assert in_flight and all(peak <= limit for limit, peak in in_flight.items())
  assert set(in_flight) == set(budget.values())
  assert everything > max(budget.values())  # Unlimited, orbax writes more at once.
  for item in ITEMS:
    restored = checkpoint.restore_item(budgeted, 1, item, target[item])
    for name, x in restored.items():
      assert x.sharding == plan.shardings[item][name]
      np.testing.assert_array_equal(x, tree[item][name])
  unlimited.close()
  budgeted.close()


def test_saves_write_the_copy_uncompressed_and_compressed_checkpoints_still_restore(tmp_path):
  mesh = bvs.make_mesh([("data", 8)])
  tree = {item: {"w": jnp.ones((64, 1024))} for item in ITEMS}  # 256 KiB each, compressible.
  plan = bvs.plan(tree, [(".*", 'fsdp(axis="data", min_size_to_shard_mb=0)')], mesh)
  state = jax.device_put(tree, plan.shardings)
  ours = checkpoint.open_manager(str(tmp_path / "ours"))
  checkpoint.save(ours, 1, saver.host_copy(state), {"step": 1}, force=True)
  ours.close()
  handlers = {item: ocp.PyTreeCheckpointHandler() for item in ITEMS}  # orbax's default: zstd.
  before = ocp.CheckpointManager(
      tmp_path / "before", item_handlers={**handlers, checkpoint.META: ocp.JsonCheckpointHandler()}
  )
  checkpoint.save(before, 1, state, {"step": 1}, force=True)
  before.close()
  written = lambda run: sum(f.stat().st_size for f in (tmp_path / run / "1").rglob("*"))
  assert written("before") < 2 * 256 * 1024 / 10 < 2 * 256 * 1024 < written("ours")
  reader = checkpoint.open_manager(str(tmp_path / "before"), read_only=True)
  for item in ITEMS:
    restored = checkpoint.restore_item(reader, 1, item, plan.abstract()[item])
    np.testing.assert_array_equal(restored["w"], tree[item]["w"])
  reader.close()
