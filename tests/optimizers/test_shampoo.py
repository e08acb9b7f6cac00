"""The project's Shampoo: blocked statistics and roots, and the published implementation's
trajectory (precondition-opt 0.3.0 ``distributed_shampoo``, recorded in
``tests/data/optimizer_reference.npz`` by ``tools/make_reference_data.py``)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from bv_sharding import optimizers as bv_optimizers
from bv_sharding.optimizers.placement import Stacks
from tests.helpers import MIXED_PARAMS, load_tool, max_deviation, recorded_trajectories
from trainers.optimizers import scale_by_shampoo, shampoo

# Shapes of a state, a param's block stacks (a Stacks node) as a list of shapes.
SHAPES = lambda tree: jax.tree.map(
    lambda x: [y.shape for y in x] if isinstance(x, Stacks) else jnp.shape(x),
    tree,
    is_leaf=lambda x: isinstance(x, Stacks),
)


def _is_param_state(x) -> bool:
  return hasattr(x, "stats")


def test_shampoo_state_layout_is_blocked_stats_and_roots():
  """Roots are kept when they outlive a step (refreshed every 2 here, every 10 by default);
  refreshed on every step the state keeps none."""
  fresh = scale_by_shampoo(block_size=8, graft_type="adam", update_preconditioners_freq=1).init(
      MIXED_PARAMS
  )
  assert all(s.roots is None for s in jax.tree.leaves(fresh.per_param, is_leaf=_is_param_state))
  state = scale_by_shampoo(block_size=8, graft_type="adam", update_preconditioners_freq=2).init(
      MIXED_PARAMS
  )
  layout = jax.tree.map(
      lambda s: (SHAPES(s.stats), SHAPES(s.roots)),
      state.per_param,
      is_leaf=_is_param_state,
  )
  # The block grid first; statistics packed (b / 2 + 1, b) where b is even, roots whole.
  assert layout["w"] == ([(1, 1, 5, 8), (1, 1, 3, 4)], [(1, 1, 8, 8), (1, 1, 4, 4)])
  assert layout["b"] == ([(1, 3, 4)], [(1, 4, 4)])  # 1-D: one factor
  assert layout["s"] == ([], [])  # scalar: graft only
  assert layout["big"] == ([(2, 375, 5, 8)] * 2, [(2, 375, 8, 8)] * 2)  # 2 x 375 blocks
  assert layout["stack"] == (
      [(1, 1, 1, 3, 3), (1, 1, 1, 4, 6), (1, 1, 1, 5, 5)],  # odd sizes stored whole
      [(1, 1, 1, 3, 3), (1, 1, 1, 6, 6), (1, 1, 1, 5, 5)],
  )
  per_param = state.per_param["w"]
  assert per_param.graft_nu.shape == per_param.momentum.shape == (8, 4)
  assert state.count.shape == ()


reference = load_tool("make_reference_data")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("run", list(reference.SHAMPOO_RUNS))
def test_shampoo_matches_distributed_shampoo(run):
  """Both use eigh roots of the same statistics (initialised to
  matrix_epsilon * I, relative ridge; the reference was recorded with ``eigh=True``, so
  ours is pinned to ``root_method="eigh"``). They differ in how the largest
  eigenvalue for the ridge is found (power iteration vs eigh) and in float32
  eigh round-off, which the ill-conditioned 8x8 blocks amplify: measured max
  deviation 1.2e-4 (rmsprop graft + Nesterov; params up to ~2.6, loss up to
  ~14) and 1.4e-5 (sgd graft, delayed start, roots every 2 steps);
  tolerance 1e-3. (Our default coupled Newton roots: 2.9e-4 and 2.7e-5.) (With zero-initialised statistics the deviation grows to
  ~0.35, so the test does detect algorithmic differences.)"""
  params, data, section = recorded_trajectories()
  settings = dict(reference.SHAMPOO_RUNS[run])  # Every argument the defaults would set.
  # distributed_shampoo steps by the heavy-ball sum, ours by its average: (1 - beta1) of it.
  learning_rate = settings.pop("learning_rate") / (1.0 - settings["beta1"])
  optimizer = shampoo(
      learning_rate,
      nesterov=True,
      exponent_override=None,
      weight_decay=0.0,
      root_method="eigh",
      refresh_groups=1,  # Every tile's roots on one step, as distributed_shampoo's.
      **settings,
  )
  ours = reference.run(optimizer, params, data)
  assert max_deviation(ours, section(run)) < 1e-3


def _changed_tiles(tx, params, steps: int) -> list[dict]:
  """Per step, per param: which tiles' roots changed (any factor's), in grid order."""
  state, step, changed = tx.init(params), jax.jit(tx.update), []
  for i in range(steps):
    grads = jax.tree.map(lambda x, i=i: jax.random.normal(jax.random.key(i), x.shape), params)
    old = state.per_param
    _, state = step(grads, state)
    changed.append(
        {
            k: functools.reduce(
                jnp.logical_or,
                [jnp.any(n != o, axis=(-2, -1)).ravel() for n, o in zip(s.roots, old[k].roots)],
            ).tolist()
            for k, s in state.per_param.items()
        }
    )
  return changed


def test_roots_refresh_in_groups_of_tiles_each_once_per_period():
  """Refreshed in groups (the default: one per step of ``update_preconditioners_freq``), a
  tile's group is its place among the tiles of its shape, counted over the params in order:
  "a"'s 2 tiles are 0 and 1, "w"'s 6 are 2 to 7, and group ``place % 3`` refreshes when
  ``count % 3`` is it. On each step only that group's roots change, so after 3 steps every
  tile's have changed exactly once; every tile's change on the step before preconditioning
  starts (count 4 here). With one group every tile's change every 3rd step, none between
  (distributed Shampoo's schedule)."""
  params = {"a": jnp.ones((4, 8)), "w": jnp.ones((8, 12))}  # 1 x 2 and 2 x 3 tiles of 4 x 4
  place = {"a": [0, 1], "w": list(range(2, 8))}
  tx = scale_by_shampoo(block_size=4, update_preconditioners_freq=3, start_preconditioning_step=5)
  changed = _changed_tiles(tx, params, 7)
  for count, step in enumerate(changed):
    due = lambda p, count=count: p % 3 == count % 3 or count == 4
    assert step == {k: [due(p) for p in places] for k, places in place.items()}, count
  for k, places in place.items():
    assert [sum(step[k][t] for step in changed[:3]) for t in range(len(places))] == [1] * len(
        places
    )
  tx = scale_by_shampoo(block_size=4, update_preconditioners_freq=3, refresh_groups=1)
  every = [{k: [count % 3 == 0] * len(p) for k, p in place.items()} for count in range(6)]
  assert _changed_tiles(tx, params, 6) == every


def test_roots_of_the_due_tiles_alone_are_the_same_roots():
  """Where work is skipped under ``lax.cond`` (an accelerator; forced here by ``skipping``) a
  stack computes the roots of its tiles due alone, gathered: the same steps as computing
  every tile's and picking the due ones'."""
  params = {"a": jnp.ones((4, 8)), "w": jnp.ones((8, 12))}
  tx = scale_by_shampoo(block_size=4, update_preconditioners_freq=3, start_preconditioning_step=1)
  runs = []
  for skip in (False, True):
    with bv_optimizers.skipping(skip):
      state, step, updates = tx.init(params), jax.jit(tx.update), []
      for i in range(4):
        grads = jax.tree.map(lambda x, i=i: jax.random.normal(jax.random.key(i), x.shape), params)
        out, state = step(grads, state)
        updates.append(out)
      runs.append((updates, state))
  (picked, a), (gathered, b) = runs
  close = lambda x, y: all(
      np.allclose(u, v, rtol=1e-5, atol=1e-6)
      for u, v in zip(jax.tree.leaves(x), jax.tree.leaves(y))
  )
  assert close(picked, gathered) and close(a, b)


def _layout_run(params, specs, mesh, steps: int, **kwargs):
  """``(updates per step, final state)`` of ``scale_by_shampoo`` on ``params`` laid out by
  ``specs`` on ``mesh``, each step's gradient drawn from its own key."""
  tx = bv_optimizers.scale_by_shampoo(
      block_size=8, layout=bv_optimizers.ParamLayout(specs, mesh), **kwargs
  )
  state, step, updates = tx.init(params), jax.jit(tx.update), []
  for i in range(steps):
    grads = jax.tree.map(lambda x, i=i: jax.random.normal(jax.random.key(i), x.shape), params)
    out, state = step(grads, state)
    updates.append(out)
  return updates, state


def test_resident_pools_take_the_same_steps_and_give_their_state_back():
  """Pools keeping their statistics and roots where they run (``resident_padding``) take the
  steps of pools moving them there and back, to float rounding (the 1-D param's pool is one of
  its own, not run in another's padding); their members keep no stacks of their own, and the
  state given back (``canonical_state``) is the other run's, on a refresh step and off."""
  mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  params = {"w": jnp.ones((16, 8)), "b": jnp.ones(16), "s": jnp.ones(())}
  specs = {"w": P("data", None), "b": P("data"), "s": P()}
  kwargs = dict(update_preconditioners_freq=3, start_preconditioning_step=1)
  with jax.set_mesh(mesh):
    moved, state = _layout_run(params, specs, mesh, 5, **kwargs)
    kept, held = _layout_run(params, specs, mesh, 5, resident_padding=4.0, **kwargs)
  assert [sorted(pool) for pool in held.pools] == [["index", "roots", "stats"]] * 2  # "b", "w"
  assert all(not s.stats and not s.roots for s in held.per_param.values())
  close = lambda a, b: all(
      np.allclose(x, y, rtol=1e-5, atol=1e-7)
      for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
  )
  assert all(close(a, b) for a, b in zip(moved, kept))
  given = bv_optimizers.canonical_state(held, params, bv_optimizers.ParamLayout(specs, mesh))
  assert jax.tree.structure(given) == jax.tree.structure(state) and close(given, state)


def test_params_with_a_dim_over_the_limit_step_along_the_graft_alone():
  """A param with a dim over ``skip_preconditioning_dim_size_gt`` (an output layer's
  vocabulary) has no factors and takes the graft's steps, as with preconditioning never
  started; a stack of layers' layer axis does not count, and the other params' steps are
  preconditioned as without the limit."""
  params = {
      "head": jnp.ones((8, 40)),
      "w": jnp.ones((8, 16)),
      "stack": jnp.ones((24, 4, 8)),
  }
  mesh = jax.sharding.AbstractMesh((1,), ("data",))
  stacked = {"head": False, "w": False, "stack": True}
  layout = bv_optimizers.ParamLayout(jax.tree.map(lambda _: P(), params), mesh, stacked)
  make = lambda **kw: scale_by_shampoo(
      block_size=8,
      update_preconditioners_freq=2,
      refresh_groups=1,  # Every tile on the same steps, however many precede it.
      layout=layout,
      **{"start_preconditioning_step": 2, **kw},
  )
  limited, unlimited = make(skip_preconditioning_dim_size_gt=16), make(
      skip_preconditioning_dim_size_gt=None
  )
  never = make(skip_preconditioning_dim_size_gt=None, start_preconditioning_step=100)
  states = [tx.init(params) for tx in (limited, unlimited, never)]
  factors = [[len(s.per_param[k].stats) for k in params] for s in states[:2]]
  assert factors == [[0, 2, 2], [2, 2, 2]]
  for i in range(3):
    grads = jax.tree.map(lambda x, i=i: jax.random.normal(jax.random.key(i), x.shape), params)
    outs = []
    for k, tx in enumerate((limited, unlimited, never)):
      out, states[k] = jax.jit(tx.update)(grads, states[k])
      outs.append(out)
  # Two programs, each rounded its own way: the graft alike within float32 noise.
  np.testing.assert_allclose(outs[0]["head"], outs[2]["head"], rtol=1e-5)
  assert float(jnp.max(jnp.abs(outs[1]["head"] - outs[2]["head"]))) > 1e-3  # Preconditioned.
  np.testing.assert_allclose(outs[0]["w"], outs[1]["w"], atol=1e-6)  # Stacked apart.
