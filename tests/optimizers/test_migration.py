"""What becomes of saved optimizer state on a restore (bv_sharding/optimizers/migration.py).

Shampoo's state trained under one params' layout, migrated to another, must equal the
state trained under the other from the start when the blocks are the same tiles (the
stacks reordered, each factor with its block); other tiles, another optimizer or
another tree re-initialise it, without reading the saved state.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P

from trainers.errors import OptimizerError
from trainers.optimizers import BuiltOptimizer, ParamLayout, migrate_state, shampoo

PARAMS = {
    "w": jax.random.normal(jax.random.key(0), (8, 16)),
    "b": jnp.ones(16),
    # Never sharded: on 4 devices dealt in pieces of 4 rows (one row of 4x4 tiles each), on
    # 8 its pieces would cut its 8 tiles: pooled, and stored as one stack over the devices.
    "c": jnp.cos(jnp.arange(128.0)).reshape(16, 8),
}
SPECS = {"w": P(None, "data"), "b": P(), "c": P()}


def layout_on(devices: int) -> ParamLayout:
  return ParamLayout(SPECS, AbstractMesh((devices,), ("data",)))


def optimizer_for(layout, blocking="tiles", **storage):
  return shampoo(1e-2, block_size=4, graft_type="adam", layout=layout, blocking=blocking, **storage)


def built_on(devices: int, name: str = "shampoo", blocking="tiles", **storage) -> BuiltOptimizer:
  abstract = jax.eval_shape(lambda: PARAMS)
  rebuild = lambda layout, storage: optimizer_for(layout, blocking, **storage)
  return BuiltOptimizer(name, abstract, layout_on(devices), rebuild, storage=storage)


def trained(devices: int, steps: int = 3, **storage):
  """Shampoo's state after ``steps`` updates under the layout on ``devices``."""
  tx = optimizer_for(layout_on(devices), **storage)
  state, update = tx.init(PARAMS), jax.jit(tx.update)
  for i in range(steps):
    grads = jax.tree.map(lambda p, i=i: jnp.sin(p * (i + 1.0)), PARAMS)
    _, state = update(grads, state, PARAMS)
  return state


def checkpoint_meta(built: BuiltOptimizer) -> dict:
  """The meta a checkpoint of ``built``'s run holds, through JSON as on disk."""
  return json.loads(json.dumps({"step": 3, "opt_start": 0, **built.record()}))


def never(targets=None):
  raise AssertionError("the saved state was read, but it is re-initialised")


def same(tree=None):
  """``differs`` of a checkpoint whose leaves are the state's: no difference."""
  return None


@pytest.fixture(scope="module")
def on_4():
  return trained(4)


def test_same_optimizer_and_layout_keeps_the_state_as_saved(on_4):
  state, reason = migrate_state(
      checkpoint_meta(built_on(4)), built_on(4), same, lambda targets=None: on_4
  )
  assert state is on_4 and reason == "shampoo's, as saved"


def test_same_tiles_in_another_order_reorders_each_stack_to_its_blocks(on_4):
  # w's 16 columns in 4 shards of 4 or 2 shards of 8: the same 4x4 tiles, stacked otherwise.
  state, reason = migrate_state(
      checkpoint_meta(built_on(4)), built_on(2), same, lambda targets=None: on_4
  )
  assert "block stacks reordered" in reason and " 0 of " not in reason, reason
  assert "saved on mesh {'data': 4}, restored on mesh {'data': 2}" in reason
  on_2 = trained(2)
  moved = 0
  for got, want, saved in zip(*map(jax.tree.leaves, (state, on_2, on_4)), strict=True):
    # Each factor preconditions the block it was fitted on: the run on 2 devices from the start.
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    moved += not np.array_equal(got, saved)
  assert moved > 0


def test_other_tiles_reinitialise_without_reading_the_state(on_4):
  # On 8 devices w's shards are 2 columns wide: shard-local 4x2 blocks, which 4x4 factors do
  # not fit; the param's own 4x4 tiles ("tiles", the default) are those of 4 devices.
  local = built_on(4, blocking="local")
  state, reason = migrate_state(checkpoint_meta(local), built_on(8, blocking="local"), same, never)
  assert state is None
  assert reason.startswith("its blocks differ on this mesh: opt/"), reason
  state, reason = migrate_state(
      checkpoint_meta(built_on(4)), built_on(8), same, lambda targets=None: on_4
  )
  assert "block stacks reordered" in reason, reason


def test_a_pool_stored_as_one_moves_to_and_from_another_layout(on_4):
  on_8 = trained(8)
  pools = lambda state: [
      k for k, _ in jax.tree_util.tree_flatten_with_path(state)[0] if "pools" in str(k)
  ]
  assert pools(on_8) and not pools(on_4)
  for saved, devices, want in ((on_4, 8, on_8), (on_8, 4, on_4)):
    meta = checkpoint_meta(built_on(12 - devices))
    state, reason = migrate_state(
        meta, built_on(devices), same, lambda targets=None, saved=saved: saved
    )
    assert "every factor, statistic and moment carried over" in reason, reason
    assert jax.tree.structure(state) == jax.tree.structure(want)
    for got, expected in zip(jax.tree.leaves(state), jax.tree.leaves(want), strict=True):
      np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_another_pool_padding_moves_the_stacks_as_another_layout_does():
  # On 8 devices pool_padding=1.0 also stores b's 4 tiles as one pool (padded to 8).
  default, padded = trained(8), trained(8, pool_padding=1.0)
  for saved, built, want in (
      (default, built_on(8, pool_padding=1.0), padded),
      (padded, built_on(8), default),
  ):
    meta = checkpoint_meta(built_on(8) if saved is default else built_on(8, pool_padding=1.0))
    state, reason = migrate_state(meta, built, same, lambda targets=None, saved=saved: saved)
    assert "every factor, statistic and moment carried over" in reason, reason
    assert jax.tree.structure(state) == jax.tree.structure(want)
    for got, expected in zip(jax.tree.leaves(state), jax.tree.leaves(want), strict=True):
      np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_pool_padding_stores_more_pools_as_one_and_keeps_the_math():
  # On 8 devices b's 4 tiles pad to 8 (100%): a pool stored as one only under pool_padding=1.
  def run(padding):
    tx = shampoo(1e-2, block_size=4, graft_type="adam", layout=layout_on(8), pool_padding=padding)
    state, update, directions = tx.init(PARAMS), jax.jit(tx.update), []
    for i in range(3):
      grads = jax.tree.map(lambda p, i=i: jnp.sin(p * (i + 1.0)), PARAMS)
      direction, state = update(grads, state, PARAMS)
      directions.append(direction)
    return len(state[0].pools), directions

  (default, want), (padded, got) = run(0.05), run(1.0)
  assert (default, padded) == (1, 2)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  with pytest.raises(OptimizerError, match="pool_padding=-1"):
    shampoo(1e-2, pool_padding=-1)


def test_another_optimizer_reinitialises_without_reading_the_state():
  kron = built_on(4, name="kron")
  state, reason = migrate_state(checkpoint_meta(built_on(4)), kron, same, never)
  assert (state, reason) == (None, "config.optax_name changed from 'shampoo' to 'kron'")


def test_another_tree_reinitialises_without_reading_the_state():
  mismatch = "opt/0/w is missing (expected shape (8, 16), float32)"
  state, reason = migrate_state(
      checkpoint_meta(built_on(4)), built_on(4), lambda tree=None: mismatch, never
  )
  assert (state, reason) == (None, f"its state differs: {mismatch}")


def test_the_record_is_json_and_names_optimizer_and_layout():
  record = built_on(4).record()
  assert json.loads(json.dumps(record)) == record
  assert record == {"optimizer": {"name": "shampoo", "layout": layout_on(4).record()}}
  assert BuiltOptimizer("adamw", {}).record() == {"optimizer": {"name": "adamw", "layout": None}}


def test_a_meta_written_before_the_record_is_read_as_data(on_4):
  """Older checkpoints: ``optax_name`` and ``layout`` keys at the top of the meta."""
  old = {"step": 3, "optax_name": "shampoo", "opt_start": 0, "layout": layout_on(4).record()}
  old = json.loads(json.dumps(old))
  state, reason = migrate_state(old, built_on(2), same, lambda targets=None: on_4)
  new, _ = migrate_state(checkpoint_meta(built_on(4)), built_on(2), same, lambda targets=None: on_4)
  assert "block stacks reordered" in reason, reason
  assert all(jax.tree.leaves(jax.tree.map(np.array_equal, state, new)))
  no_layout = {k: v for k, v in old.items() if k != "layout"}
  state, reason = migrate_state(no_layout, built_on(2), same, lambda targets=None: on_4)
  assert state is on_4 and reason == "shampoo's, as saved"
  assert migrate_state(old, built_on(2, name="adamw"), same, never)[0] is None


def test_no_layout_here_never_moves_stacks(on_4):
  unlaid = BuiltOptimizer("shampoo", jax.eval_shape(lambda: PARAMS))
  state, reason = migrate_state(
      checkpoint_meta(built_on(4)), unlaid, same, lambda targets=None: on_4
  )
  assert state is on_4 and reason == "shampoo's, as saved"
