"""Optimizer state saved as host arrays on 8 devices, put onto 4 and 2 with the new plan.

What any checkpointer does (big_vision's loader, orbax with target shardings): each leaf saved
as a NumPy array, read back onto another mesh in the shardings ``bvs.plan`` gives there. For
Kron, Shampoo and SOAP (``blocking="tiles"``) and Muon the state's tree, shapes and element order do
not depend on the mesh (``bv_sharding/optimizers/placement.py``), so the continued run is the
uninterrupted one. Each other device count runs in its own process (the device count is fixed
when jax starts), all four optimizers in one process. Library imports only.
"""

import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import bv_sharding as bvs
from bv_sharding.optimizers import ParamLayout, kron, muon, shampoo, soap
from tests.optimizers import strategies

SHAPES, SPECS = strategies.VIT_SHAPES, strategies.VIT_SPECS
MESH = [("data", -1), ("model", 2)]
FIRST, THEN = 6, 4  # Steps before the save, and after it.
OPTIMIZERS = ("kron", "shampoo", "muon", "soap")


def _optimizer(name: str, layout: ParamLayout):
  if name == "kron":
    scanned = {k: k == "stack" for k in SHAPES}
    return kron(
        1e-2,
        preconditioner_update_probability=1.0,
        block_size=8,
        scanned_layers=scanned,
        layout=layout,
    )
  if name == "shampoo":
    return shampoo(1e-2, block_size=8, start_preconditioning_step=1, layout=layout)
  if name == "soap":
    return soap(1e-2, block_size=8, precondition_frequency=2, layout=layout)
  return muon(1e-2, layout=layout)


def _loss(params):
  return sum(jnp.sum(jnp.sin(p) ** 2 + 0.1 * p) for p in jax.tree.leaves(params))


def _planned(name: str, devices: int):
  """``(tx, plan)`` of optimizer ``name`` on ``devices`` devices, as a user's loop plans them."""
  mesh = bvs.make_mesh(MESH, devices=jax.devices()[:devices])
  params = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in SHAPES.items()}
  params_plan = bvs.plan({"params": params}, strategies.by_dims(SPECS), mesh)
  tx = _optimizer(name, ParamLayout.from_plan(params_plan))
  tree = {"params": params, "opt": jax.eval_shape(tx.init, params)}
  return tx, bvs.plan(tree, strategies.by_dims(SPECS), mesh, params=params_plan)


def _stepper(tx, plan):
  """One jitted step of ``{"params", "opt"}`` in ``plan``'s shardings (compiled once)."""

  def step(state):
    params, opt = state["params"], state["opt"]
    updates, opt = tx.update(jax.grad(_loss)(params), opt, params)
    return {"params": jax.tree.map(jnp.add, params, updates), "opt": opt}

  return jax.jit(step, out_shardings=plan.shardings)


def _steps(step, state, n: int):
  for _ in range(n):
    state = step(state)
  return state


def _host(state) -> dict[str, np.ndarray]:
  return {name: np.asarray(x) for name, x in bvs.names.flatten(state)[0]}


def continue_from(directory: pathlib.Path, devices: int) -> None:
  """Every optimizer's saved state put onto ``devices`` devices, ``THEN`` more steps; writes
  the params reached and the state tree's description."""
  for name in OPTIMIZERS:
    tx, plan = _planned(name, devices)
    saved = np.load(directory / f"{name}.npz")
    named, treedef = bvs.names.flatten(plan.abstract())
    state = jax.device_put(
        treedef.unflatten([saved[n] for n, _ in named]),
        plan.shardings,
    )
    assert not plan.mismatches(state), plan.mismatches(state)
    state = _steps(_stepper(tx, plan), state, THEN)
    np.savez(directory / f"{name}_on_{devices}.npz", **_host(state["params"]))
    tree = {n: list(x.shape) for n, x in named}
    (directory / f"{name}_on_{devices}.json").write_text(json.dumps(tree))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """``(directory, {optimizer: (state tree, params of the uninterrupted run)})`` on 8 devices."""
  directory = tmp_path_factory.mktemp("any_mesh")
  out = {}
  for name in OPTIMIZERS:
    tx, plan = _planned(name, 8)
    keys = jax.random.split(jax.random.key(0), len(SHAPES))
    params = {k: jax.random.normal(key, s) for key, (k, s) in zip(keys, SHAPES.items())}
    state = jax.device_put({"params": params, "opt": tx.init(params)}, plan.shardings)
    step = _stepper(tx, plan)
    state = _steps(step, state, FIRST)
    np.savez(directory / f"{name}.npz", **_host(state))
    tree = {n: list(x.shape) for n, x in bvs.names.flatten(plan.abstract())[0]}
    out[name] = (tree, _host(_steps(step, state, THEN)["params"]))
  return directory, out


@pytest.mark.timeout(600)
@pytest.mark.xdist_group("any-mesh-saved")  # One worker makes `saved` for both.
@pytest.mark.parametrize("devices", [2, 4])
def test_a_state_saved_on_8_devices_continues_on_fewer_as_the_uninterrupted_run(saved, devices):
  directory, runs = saved
  env = {**os.environ, "JAX_NUM_CPU_DEVICES": str(devices), "JAX_PLATFORMS": "cpu"}
  code = f"from tests.optimizers import test_placement_any_mesh as t; t.continue_from(t.pathlib.Path({str(directory)!r}), {devices})"
  root = pathlib.Path(__file__).resolve().parents[2]
  subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=root, timeout=540)
  for name, (tree, params) in runs.items():
    assert json.loads((directory / f"{name}_on_{devices}.json").read_text()) == tree, name
    got = np.load(directory / f"{name}_on_{devices}.npz")
    for key, want in params.items():
      np.testing.assert_allclose(got[key], want, rtol=0, atol=1e-4, err_msg=f"{name} {key}")
