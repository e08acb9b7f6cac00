"""What becomes of saved optimizer state on a restore (bv_sharding/optimizers/migration.py).

Shampoo's state trained under one params' layout is, with the default tiles, the state trained
under any other (the same tree, each stack in its blocks' order): a restore keeps it as saved.
Other tiles (``blocking="local"`` on another mesh), another optimizer or another tree
re-initialise it, without reading the saved state.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P

from trainers.optimizers import BuiltOptimizer, ParamLayout, migrate_state, shampoo

PARAMS = {
    "w": jax.random.normal(jax.random.key(0), (8, 16)),
    "b": jnp.ones(16),
    # Never sharded: on 4 devices dealt in pieces of 4 rows (one row of 4x4 tiles each), on
    # 8 its pieces would cut its 8 tiles: pooled over the devices.
    "c": jnp.cos(jnp.arange(128.0)).reshape(16, 8),
}
SPECS = {"w": P(None, "data"), "b": P(), "c": P()}


def layout_on(devices: int) -> ParamLayout:
  return ParamLayout(SPECS, AbstractMesh((devices,), ("data",)))


def optimizer_for(layout, blocking="tiles"):
  return shampoo(1e-2, block_size=4, graft_type="adam", layout=layout, blocking=blocking)


def built_on(devices: int, name: str = "shampoo", blocking="tiles") -> BuiltOptimizer:
  abstract = jax.eval_shape(lambda: PARAMS)
  tx = optimizer_for(layout_on(devices), blocking)
  return BuiltOptimizer(name, abstract, layout_on(devices), jax.eval_shape(tx.init, abstract))


def trained(devices: int, steps: int = 3, blocking="tiles"):
  """Shampoo's state after ``steps`` updates under the layout on ``devices``."""
  tx = optimizer_for(layout_on(devices), blocking)
  state, update = tx.init(PARAMS), jax.jit(tx.update)
  for i in range(steps):
    grads = jax.tree.map(lambda p, i=i: jnp.sin(p * (i + 1.0)), PARAMS)
    _, state = update(grads, state, PARAMS)
  return state


def checkpoint_meta(built: BuiltOptimizer) -> dict:
  """The meta a checkpoint of ``built``'s run holds, through JSON as on disk."""
  return json.loads(json.dumps({"step": 3, "opt_start": 0, **built.record()}))


def never():
  raise AssertionError("the saved state was read, but it is re-initialised")


def same():
  """``differs`` of a checkpoint whose leaves are the state's: no difference."""
  return None


@pytest.fixture(scope="module")
def on_4():
  return trained(4)


def test_same_optimizer_and_layout_keeps_the_state_as_saved(on_4):
  state, reason = migrate_state(checkpoint_meta(built_on(4)), built_on(4), same, lambda: on_4)
  assert state is on_4 and reason == "shampoo's, as saved"


@pytest.mark.parametrize("devices", [2, 8])
def test_the_same_tiles_on_another_mesh_are_the_same_state(on_4, devices):
  # w's 16 columns in 4 shards of 4, 2 of 8 or 8 of 2: the same 4x4 tiles; c dealt on 4 devices,
  # pooled on 8. The state trained there from the start is the saved one, leaf by leaf.
  state, reason = migrate_state(checkpoint_meta(built_on(4)), built_on(devices), same, lambda: on_4)
  assert state is on_4, reason
  assert f"saved on mesh {{'data': 4}}, restored on mesh {{'data': {devices}}} as saved" in reason
  other = trained(devices)
  assert jax.tree.structure(other) == jax.tree.structure(on_4)
  for got, want in zip(jax.tree.leaves(on_4), jax.tree.leaves(other), strict=True):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_other_tiles_reinitialise_without_reading_the_state():
  # On 8 devices w's shards are 2 columns wide: shard-local 4x2 blocks, which 4x4 factors do
  # not fit.
  local = built_on(4, blocking="local")
  state, reason = migrate_state(checkpoint_meta(local), built_on(8, blocking="local"), same, never)
  assert state is None
  assert reason.startswith("its blocks differ on this mesh: opt/"), reason


def test_another_optimizer_reinitialises_without_reading_the_state():
  kron = built_on(4, name="kron")
  state, reason = migrate_state(checkpoint_meta(built_on(4)), kron, same, never)
  assert (state, reason) == (None, "config.optax_name changed from 'shampoo' to 'kron'")


def test_another_tree_reinitialises_without_reading_the_state():
  mismatch = "opt/0/w is missing (expected shape (8, 16), float32)"
  state, reason = migrate_state(checkpoint_meta(built_on(4)), built_on(4), lambda: mismatch, never)
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
  state, reason = migrate_state(old, built_on(2), same, lambda: on_4)
  assert state is on_4 and "restored on mesh {'data': 2} as saved" in reason, reason
  no_layout = {k: v for k, v in old.items() if k != "layout"}
  state, reason = migrate_state(no_layout, built_on(2), same, lambda: on_4)
  assert state is on_4 and reason == "shampoo's, as saved"
  assert migrate_state(old, built_on(2, name="adamw"), same, never)[0] is None


def test_no_layout_here_never_moves_stacks(on_4):
  unlaid = BuiltOptimizer("shampoo", jax.eval_shape(lambda: PARAMS))
  state, reason = migrate_state(checkpoint_meta(built_on(4)), unlaid, same, lambda: on_4)
  assert state is on_4 and reason == "shampoo's, as saved"
