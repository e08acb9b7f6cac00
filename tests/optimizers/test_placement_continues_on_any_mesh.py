"""The same optimizer state continues on any mesh, in a user's own loop.

A user's loop (``own_loop``: ``bvs.plan`` over params and state, ``jax.jit(tx.init,
out_shardings=...)``, a jitted step) trains on 8 devices, saves its state as host arrays
(``jax.device_get``; Kron's and SOAP's pools given back to the params first,
``canonical_state``), and puts them onto 2 or 4 of the devices with that mesh's plan. Every
optimizer of the library at its defaults, pinned here (Shampoo's grafts Adam), then continues
within 1e-4 of the 8-device run's own continuation (the update since the move, relative; SOAP
within 1e-3 from the step that refits its bases, which agree up to sign), and through host
arrays onto the same 8 devices bit for bit. Both continuations' first update is a one-device
recompute's, up to float rounding: neither side departs (docs/optimizers.md, "Moving a state to
another mesh"). Library imports only.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import bv_sharding as bvs
from bv_sharding.optimizers import (
    SoapParamState,
    precond_update_prob_schedule,
    scale_by_kron,
    scale_by_muon,
    scale_by_shampoo,
    scale_by_soap,
)
from tests.optimizers import own_loop

# A 3-D kernel, a head and a bias: on 8 devices each kernel's one tile spans shards (pooled),
# on 2 it spans fewer.
SHAPES = {"embed": (16, 4, 8), "head": (32, 8), "bias": (8,)}
SPECS = {"embed": ("data", None, None), "head": ("data", None), "bias": ()}
FIRST, THEN = 8, 6  # Steps before the move (SOAP refreshes its bases at step 10), and after.

# Each optimizer at the library's defaults, written out, and the lr its run trains at.
OPTIMIZERS = {
    "adam": (lambda layout: optax.scale_by_adam(b1=0.9, b2=0.999, eps=1e-8), 1e-2),
    "kron": (
        lambda layout: scale_by_kron(
            b1=0.9,
            preconditioner_update_probability=precond_update_prob_schedule(),
            preconditioner_lr=0.1,
            block_size=256,
            resident_padding=1.5,
            layout=layout,
        ),
        1e-2,
    ),
    "shampoo": (
        lambda layout: scale_by_shampoo(
            block_size=256,
            beta1=0.9,
            beta2=0.999,
            matrix_epsilon=1e-6,
            start_preconditioning_step=10,
            graft_type="adam",
            layout=layout,
        ),
        1e-2,
    ),
    "soap": (
        lambda layout: scale_by_soap(
            betas=(0.95, 0.95),
            precondition_frequency=10,
            block_size=1024,
            resident_padding=1.5,
            power_damping=1e-2,
            relative_eps=0.0,
            layout=layout,
        ),
        1e-2,
    ),
    "muon": (lambda layout: scale_by_muon(beta=0.95, ns_steps=5, layout=layout), 2e-2),
}


def _data():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(64, 16)).astype(np.float32)
  labels = np.argmax(x @ rng.normal(size=(16, 8)), axis=-1)
  return jnp.asarray(x), jnp.asarray(labels)


def _loss(params, k):
  del k  # One batch: the run's loss falls at these lrs.
  x, labels = _data()
  h = jnp.tanh(jnp.einsum("bi,ihk->bhk", x, params["embed"])).reshape(x.shape[0], -1)
  logits = h @ params["head"] + params["bias"]
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def _params():
  rng = np.random.default_rng(1)
  scale = {"embed": 0.25, "head": 32**-0.5, "bias": 0.0}
  return {k: (scale[k] * rng.normal(size=s)).astype(np.float32) for k, s in SHAPES.items()}


def _loop(name: str, devices: int):
  make, lr = OPTIMIZERS[name]
  mesh = bvs.make_mesh([("data", devices)], devices=jax.devices()[:devices])
  make_tx = lambda layout: optax.chain(make(layout), optax.scale(-lr))
  return own_loop.loop(make_tx, SHAPES, SPECS, mesh, _loss)


def _relative(got: dict, want: dict, start: dict) -> float:
  """The largest, over the params, relative difference of the updates since ``start``."""
  out = 0.0
  for k, w in want.items():
    update = np.asarray(w) - start[k]
    out = max(out, float(np.linalg.norm(np.asarray(got[k]) - w) / np.linalg.norm(update)))
  return out


def _bases_apart(got, want) -> float | None:
  """The largest difference of SOAP's bases in two canonical states, each column up to its
  sign (an eigenvector's sign is arbitrary); None: the states keep no bases."""
  if not _bases(want):
    return None
  out = 0.0
  for g, w in zip(_bases(got), _bases(want), strict=True):
    sign = np.sign(np.sum(g * w, axis=-2, keepdims=True))
    out = max(out, float(np.max(np.abs(g * sign - w))))
  return out


def _bases(state) -> list[np.ndarray]:
  nodes = jax.tree.leaves(state["opt"], is_leaf=lambda x: isinstance(x, SoapParamState))
  return [np.asarray(b) for n in nodes if isinstance(n, SoapParamState) for b in n.bases]


def moved(name: str, meshes=(4, 2)) -> dict:
  """Trains ``name`` ``FIRST`` steps on 8 devices and saves its state as host arrays, then
  ``THEN`` more steps on 8 from the device state (the run) and from the host arrays (the
  control), and from them on each of ``meshes``; one step from them on 1 device.

  Returns ``{"losses": the run's, "exact": the control is the run bit for bit, "first": {n:
  the first update's relative difference from 1 device's}, "bases": {n: SOAP's bases apart
  after the steps, or None}, n: each step's relative difference from the run}``.
  """
  on8 = _loop(name, 8)
  state, _, _ = own_loop.steps(on8, own_loop.born(on8, _params()), 0, FIRST)
  host = own_loop.saved(on8, state)
  end, losses, want = own_loop.steps(on8, state, FIRST, THEN)
  end = own_loop.saved(on8, end)
  back, _, _ = own_loop.steps(on8, own_loop.restored(on8, host), FIRST, THEN)
  same = jax.tree.map(np.array_equal, own_loop.saved(on8, back), end)
  one = _loop(name, 1)
  _, _, (first,) = own_loop.steps(one, own_loop.restored(one, host), FIRST, 1)
  start = host["params"]
  out = {"losses": losses, "exact": all(jax.tree.leaves(same)), "bases": {}}
  out["first"] = {8: _relative(want[0], first, start)}
  for n in meshes:
    run = _loop(name, n)
    got_end, _, got = own_loop.steps(run, own_loop.restored(run, host), FIRST, THEN)
    out[n] = [_relative(g, w, start) for g, w in zip(got, want)]
    out["first"][n] = _relative(got[0], first, start)
    out["bases"][n] = _bases_apart(own_loop.saved(run, got_end), end)
  return out


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_state_moved_to_2_or_4_devices_continues_as_the_8_device_run(name):
  out = moved(name)
  losses = out["losses"]
  assert all(b <= a for a, b in zip(losses, losses[1:])), losses  # An lr the run trains at.
  assert out["exact"]  # 8 -> 8 through host arrays: the run itself.
  # Neither side departs: both first updates are one device's, up to rounding.
  assert max(out["first"].values()) < 1e-4, out["first"]
  # SOAP refits its bases at step 10 (index 2 here) on statistics rounded otherwise.
  refit = 10 - FIRST if name == "soap" else THEN
  for n in (4, 2):
    assert max(out[n][:refit]) < 1e-4, (n, out[n])
    assert max(out[n]) < 1e-3, (n, out[n])
    bases = out["bases"][n]
    assert (bases is not None) == (name == "soap") and (bases or 0.0) < 1e-3, out["bases"]
