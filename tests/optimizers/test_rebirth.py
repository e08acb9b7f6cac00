"""An optimizer change mid-run (bv_sharding/optimizers/rebirth.py): the new optimizer's first
updates at the scale of its own run.

Every ordered pair of the ten registry optimizers: 20 steps of the first on fixed grads
(a signal, noise and a pull towards zero), the state reborn for the second at step 20 as
the trainer's restore does it (``BuiltOptimizer.reborn``), 5 steps of the second; their
updates' RMS against the second's own updates at steps 21..25 of a run that never changed:
finite and within 0.5-2x at each of the five steps, for every pair. The first update's ratio
for every pair (docs/durability.md's table)::

  python -c "from tests.optimizers.test_rebirth import *; print(first_ratios(trained()))"
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from bv_sharding.errors import OptimizerError
from bv_sharding.optimizers import rebirth
from bv_sharding.optimizers.rebirth import MOVING, REFILLED, leaf_names
from trainers.optimizers import BuiltOptimizer, make_schedule, registry

# One pytest-xdist worker runs the module: it makes `runs` (ten optimizers jitted) once.
pytestmark = pytest.mark.xdist_group("rebirth-runs")
PARAMS = {"w": jax.random.normal(jax.random.key(0), (8, 6)), "b": jnp.full(6, 0.5, jnp.float32)}
SIGNAL = jax.tree.map(lambda p: jnp.cos(3.0 * p), PARAMS)
SCHEDULE = {"total_steps": 40, "warmup_steps": 2}
LR = 1e-2


def grads(t, params):
  keys = {"w": jax.random.key(1), "b": jax.random.key(2)}
  noise = jax.tree.map(
      lambda k, p: jax.random.normal(jax.random.fold_in(k, t), p.shape), keys, params
  )
  return jax.tree.map(lambda s, n, p: s + 0.5 * n + 0.1 * p, SIGNAL, noise, params)


def five_steps(tx):
  """``(state, params, start) -> (state, params, rms)``: 5 steps from ``start``, jitted once."""

  def step(carry, t):
    state, params = carry
    updates, state = tx.update(grads(t, params), state, params)
    rms = jnp.sqrt(optax.tree.norm(updates, squared=True) / optax.tree.size(updates))
    return (state, optax.apply_updates(params, updates)), rms

  def run(state, params, start):
    (state, params), rms = jax.lax.scan(step, (state, params), start + jnp.arange(5))
    return state, params, rms

  return jax.jit(run)


def trained() -> dict:
  """``{name: (init, run, state at 20, params at 20, own RMS at 21..25)}``, jitted once each."""
  out = {}
  for name in registry.OPTIMIZERS:
    tx = registry.make_optimizer(name, LR, schedule=SCHEDULE, weight_decay=1e-4)
    init, run, params = jax.jit(tx.init), five_steps(tx), jax.device_put(PARAMS)
    state = init(params)
    for start in range(0, 20, 5):
      state, params, _ = run(state, params, start)
    out[name] = (init, run, state, params, np.asarray(run(state, params, 20)[2]))
  return out


@pytest.fixture(scope="module")
def runs():
  return trained()


def reborn(runs, before: str, after: str):
  """``(state, carried, renewed)``: ``after``'s state reborn at step 20 from ``before``'s."""
  state, params = runs[before][2:4]
  init = runs[after][0]
  saved = dict(zip(leaf_names(state), jax.tree.leaves(state)))
  table = {n: (tuple(x.shape), str(x.dtype)) for n, x in saved.items()}
  schedule = make_schedule(LR, **SCHEDULE)
  decays = registry.state_decays(after, {})
  built = BuiltOptimizer(after, PARAMS, learning_rate=schedule, decays=decays)
  meta = BuiltOptimizer(before, PARAMS, decays=registry.state_decays(before, {})).record()
  return built.reborn(init(params), 20, meta, table, lambda t: {n: saved[n] for n in t})


def changed(runs, before: str, after: str):
  """``(RMS at 21..25, carried, renewed)`` of ``before`` changed to ``after`` at step 20."""
  state, carried, renewed = reborn(runs, before, after)
  return np.asarray(runs[after][1](state, runs[before][3], 20)[2]), carried, renewed


def ratio(runs, before: str, after: str) -> np.ndarray:
  """RMS of ``before`` changed to ``after`` at step 20, at 21..25, over ``after``'s own."""
  return changed(runs, before, after)[0] / runs[after][4]


def first_ratios(runs) -> dict[str, float]:
  """``{"before -> after": the first update's ratio}`` of every ordered pair, rounded."""
  pairs = itertools.permutations(registry.OPTIMIZERS, 2)
  return {f"{a} -> {b}": round(float(ratio(runs, a, b)[0]), 2) for a, b in pairs}


@pytest.mark.parametrize(("before", "after"), itertools.permutations(registry.OPTIMIZERS, 2))
def test_an_optimizer_change_starts_at_the_new_optimizers_own_scale(runs, before, after):
  r = ratio(runs, before, after)
  assert np.all(np.isfinite(r)) and r.max() <= 2.0 and r.min() >= 0.5, r.round(2)


def buffers(x: jax.Array) -> tuple:
  return tuple(shard.data.unsafe_buffer_pointer() for shard in x.addressable_shards)


def test_every_leaf_of_a_reborn_state_is_its_own_buffer(runs):
  # A train step donates the state: one array in two leaves fails its first step ("Attempt to
  # donate the same buffer twice", then a segfault). Adam's count was carried into both Muon's
  # and its inner Adam's as one array (issue 67); each is its own copy now.
  shared = {}
  for before, after in itertools.permutations(registry.OPTIMIZERS, 2):
    state, carried, _ = reborn(runs, before, after)
    held = [buffers(x) for x in jax.tree.leaves(state)]
    if len(set(held)) < len(held):
      shared[before, after] = carried
  assert shared == {}
  state, carried, _ = reborn(runs, "adamw", "muon")
  counts = [leaf for leaf, source in carried.items() if source == "0/0/count"]
  assert len(counts) == 2, carried  # Muon's count and its inner Adam's, from Adam's.


def test_a_count_is_carried_only_with_every_moment_it_corrects(runs):
  # Kron has no second moment: Adam's group (count, mu, nu) is born afresh, as logged.
  rms, carried, renewed = changed(runs, "kron", "adamw")
  assert carried == {} and renewed == ["0/0/count", "0/0/mu/*", "0/0/nu/*"]
  # LAMB's are Adam's moments: all three carried, the update as Adam's own run makes it.
  rms, carried, renewed = changed(runs, "lamb", "adamw")
  assert sorted(carried) == ["0/0/count", "0/0/mu/b", "0/0/mu/w", "0/0/nu/b", "0/0/nu/w"]
  assert renewed == [] and rms == pytest.approx(runs["adamw"][4], rel=0.05)
  # Adam's mu and count into Kron, whose count corrects only mu: carried, the factors born.
  _, carried, renewed = changed(runs, "adamw", "kron")
  assert carried == {"0/0/mu/b": "0/0/mu/b", "0/0/mu/w": "0/0/mu/w", "0/0/count": "0/0/count"}
  assert "0/0/update_counter" in renewed and "0/0/Qs_preconditioners/*/0" in renewed
  # Lion's count does not correct its mu: not carried into Kron's bias correction.
  assert changed(runs, "lion", "kron")[1] == {}


def test_a_heavy_ball_sum_is_born_from_a_saved_first_moment(runs):
  # SGD's trace, a sum of grads: Adam's mu (bias-corrected by its count) / (1 - momentum).
  _, carried, renewed = changed(runs, "adamw", "sgd")
  assert carried == {"1/0/trace/b": "0/0/mu/b", "1/0/trace/w": "0/0/mu/w"} and renewed == []
  # Lion's mu, corrected with the decay its checkpoint recorded (b2 0.99: 18% of the mean at
  # step 20), as the sgd run's own trace: within 25% from the first step.
  rms, carried, renewed = changed(runs, "lion", "sgd")
  assert carried == {"1/0/trace/b": "0/0/mu/b", "1/0/trace/w": "0/0/mu/w"} and renewed == []
  assert rms == pytest.approx(runs["sgd"][4], rel=0.25)
  # Shampoo's momentum, a sum of Adam-scaled steps: Adam's direction (mu, nu, count).
  _, carried, renewed = changed(runs, "lamb", "shampoo")
  assert carried["0/0/per_param/w/momentum"] == "0/0/mu/w"
  assert "0/0/count" in renewed and "0/0/per_param/*/graft_nu" in renewed
  assert "0/0/per_param/*/momentum" not in renewed
  # Kron's mu has no nu beside it: Shampoo's momentum is born from it in the gradients' units
  # and its graft_nu marked so (shampoo.GRAD_UNITS): the first update divides each element by
  # sqrt(g^2 + mean^2), and starts at Shampoo's own scale (within 20%, where 0.29x at zero).
  rms, carried, renewed = changed(runs, "kron", "shampoo")
  assert carried["0/0/per_param/w/momentum"] == "0/0/mu/w"
  assert "0/0/per_param/*/momentum" not in renewed
  assert rms == pytest.approx(runs["shampoo"][4], rel=0.2)
  # SGD's trace is a first moment too ((1 - momentum) trace: the grads' mean).
  assert changed(runs, "sgd", "shampoo")[1] == {
      "0/0/per_param/b/momentum": "1/0/trace/b",
      "0/0/per_param/w/momentum": "1/0/trace/w",
  }
  # Adafactor keeps none, SOAP's lies in its own bases: born at zero and refilled (its updates
  # scaled to a full sum's while it fills), as logged.
  for before in ("adafactor", "soap"):
    _, carried, renewed = changed(runs, before, "shampoo")
    assert carried == {} and f"0/0/per_param/*/momentum{REFILLED}" in renewed
  # Shampoo's momentum is not in grads' units: SGD's trace born at zero and refilled too.
  assert changed(runs, "shampoo", "sgd")[1:] == ({}, [f"1/0/trace/*{REFILLED}"])


def test_soap_born_mid_run_moves_at_once_its_first_moment_refilled(runs):
  # Nothing carries into SOAP's bases: all born afresh, its count at 1 (a fresh run's first
  # step only fits its bases) and its mu refilled (its bias correction the refill's), as logged.
  _, carried, renewed = changed(runs, "adamw", "soap")
  assert carried == {} and renewed[:2] == [f"0/0/count{MOVING}", f"0/0/per_param/*/mu{REFILLED}"]


def test_a_sum_born_at_zero_without_a_refill_starts_at_a_fresh_runs_first_scale(runs):
  # The refill is what lifts it: the same birth with the sum left unscaled (its RefillState
  # marked full) starts at 0.15x sgd's own update, as before the refill existed.
  state, params = runs["adafactor"][2:4]
  init, run = runs["sgd"][:2]
  saved = dict(zip(leaf_names(state), jax.tree.leaves(state)))
  table = {n: (tuple(x.shape), str(x.dtype)) for n, x in saved.items()}
  decays = (registry.state_decays("sgd", {}), {})
  reborn = rebirth.reborn(init(params), 20, table, lambda t: {}, PARAMS, None, decays)[0]
  refilled = np.asarray(run(reborn, params, 20)[2]) / runs["sgd"][4]
  unscaled = np.asarray(run(rebirth.unfilled(reborn, set())[0], params, 20)[2]) / runs["sgd"][4]
  assert unscaled[0] < 0.2 and refilled.min() >= 0.5, (unscaled.round(2), refilled.round(2))


def test_a_ramped_chain_updates_as_the_chain_until_its_state_is_reborn():
  """``rebirth.ramped``: the chain's leaves under their own names, the ramp's last; a fresh
  state's updates the chain's own, bit for bit (its ramp born saturated); a state born mid-run
  (``at_step``) moves by 0, 1/3, 2/3 of the chain's updates, then by them whole."""
  chain = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(LR, weight_decay=1e-4))
  tx = rebirth.ramped(chain, 3)
  state, plain = tx.init(PARAMS), chain.init(PARAMS)
  assert leaf_names(state) == [*leaf_names(plain), "2/count"]
  scales = []
  for t in range(9):
    if t == 4:  # Both born afresh at step 4, as a resume with another optimizer does.
      state, plain = rebirth.at_step(tx.init(PARAMS), 4), chain.init(PARAMS)
    ramped, state = tx.update(grads(t, PARAMS), state, PARAMS)
    updates, plain = chain.update(grads(t, PARAMS), plain, PARAMS)
    if t < 4:
      assert all(jax.tree.leaves(jax.tree.map(np.array_equal, ramped, updates)))
    else:
      scales.append(float(ramped["w"][0, 0] / updates["w"][0, 0]))
  assert scales == pytest.approx([0.0, 1 / 3, 2 / 3, 1.0, 1.0])
  assert rebirth.unramped(state) is not None and rebirth.unramped(plain) is None
  with pytest.raises(OptimizerError, match=r"pass optax.chain\(tx\)"):
    rebirth.ramped(optax.scale_by_adam(), 3).init(PARAMS)  # Its state no chain's tuple.
