"""Record reference optimizer trajectories from the published implementations.

Runs psgd-jax 0.2.9 ``kron`` and precondition-opt 0.3.0 ``distributed_shampoo``
on a small fixed problem (``make_problem`` / ``loss_fn``) and stores the loss
and the parameters after every step in ``tests/data/optimizer_reference.npz``.
``tests/optimizers/test_kron.py`` and ``test_shampoo.py`` replay the same runs
(``KRON_RUNS``, ``SHAMPOO_RUNS``) with ``trainers.optimizers`` and compare.

The references do not import on the project's JAX/optax (psgd-jax imports
``optax._src.clipping``, removed in optax 0.2.7; distributed_shampoo uses
``jax.tree_map``, removed in JAX 0.6), so they run in a separate venv::

    python3 -m venv /work/venv-ref
    /work/venv-ref/bin/pip install psgd-jax==0.2.9 optax==0.2.6 \\
        precondition-opt==0.3.0 "jax[cpu]==0.5.3" flax==0.10.4
    /work/venv-ref/bin/python -m tools.make_reference_data   # from the repo root

(flax is only needed because psgd-jax imports ``flax.linen``.) Only this
module's top level is imported by the tests; the reference packages are
imported inside the functions that use them.
"""

from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import numpy as np

STEPS = 20
OUTPUT = pathlib.Path(__file__).resolve().parents[1] / "tests/data/optimizer_reference.npz"

# Settings shared by the reference and the replay. "update_prob" is either a
# float or the kwargs of psgd's precond_update_prob_schedule.
KRON_RUNS = {
    "kron_default": dict(
        learning_rate=0.01,
        b1=0.9,
        preconditioner_lr=0.1,
        preconditioner_init_scale=1.0,
        memory_save_mode=None,
        update_prob=1.0,
        scan_layers=False,
    ),
    "kron_scanned_one_diag_schedule": dict(
        learning_rate=0.01,
        b1=0.9,
        preconditioner_lr=0.2,
        preconditioner_init_scale=0.5,
        memory_save_mode="one_diag",
        update_prob=dict(max_prob=1.0, min_prob=0.3, decay=0.5, flat_start=3),
        scan_layers=True,
    ),
}
# One row per Shampoo run, all with blocks of 8, epsilon 1e-8 and matrix_epsilon 1e-6.
_SHAMPOO_COLUMNS = (
    "learning_rate",
    "beta1",
    "beta2",
    "graft_type",
    "start_preconditioning_step",
    "update_preconditioners_freq",
)
_SHAMPOO_ROWS = {
    "shampoo_rmsprop_nesterov": (0.01, 0.9, 0.99, "rmsprop", 0, 1),
    "shampoo_sgd_graft_delayed_freq2": (0.05, 0.0, 0.95, "sgd", 3, 2),
}
SHAMPOO_RUNS = {
    name: dict(zip(_SHAMPOO_COLUMNS, row), block_size=8, epsilon=1e-8, matrix_epsilon=1e-6)
    for name, row in _SHAMPOO_ROWS.items()
}


def make_problem(seed: int = 0) -> tuple[dict, dict]:
  """(initial params, data): a tanh layer, two linear maps and a layer stack.

  Inputs have column scales spanning 10x so the problem is ill-conditioned.
  Shapes exercise triangular (16, 16), blocked-with-padding (12, 6), 1-D,
  scalar and stacked (3, 4, 5) params.
  """
  rng = np.random.default_rng(seed)
  normal = lambda *shape: rng.standard_normal(shape).astype(np.float32)
  cols = lambda n: np.logspace(0, 1, n, dtype=np.float32)
  params = dict(
      w1=0.3 * normal(8, 4),
      b1=np.zeros(4, np.float32),
      scale=np.ones((), np.float32),
      w2=0.1 * normal(16, 16),
      w3=0.1 * normal(12, 6),
      layers=0.3 * normal(3, 4, 5),
  )
  data = dict(
      x1=normal(32, 8) * cols(8),
      t1=np.tanh(normal(32, 4)),
      x2=normal(32, 16) * cols(16),
      t2=normal(32, 16),
      x3=normal(32, 12) * cols(12),
      t3=normal(32, 6),
      x4=normal(32, 4),
      t4=normal(3, 32, 5),
  )
  return params, data


def loss_fn(params: dict, data: dict) -> jax.Array:
  """Sum of mean squared errors of the four sub-problems."""
  pred1 = params["scale"] * jnp.tanh(data["x1"] @ params["w1"] + params["b1"])
  pred4 = jnp.einsum("bi,lio->lbo", data["x4"], params["layers"])
  errors = [
      pred1 - data["t1"],
      data["x2"] @ params["w2"] - data["t2"],
      data["x3"] @ params["w3"] - data["t3"],
      pred4 - data["t4"],
  ]
  return sum(jnp.mean(jnp.square(e)) for e in errors)


def scanned_layers(params: dict, scan: bool) -> dict:
  """Which params have a leading layer axis (only ``layers``, if ``scan``)."""
  return {name: scan and name == "layers" for name in params}


def run(optimizer, params: dict, data: dict, steps: int = STEPS) -> dict:
  """Runs ``steps`` updates; returns losses (steps+1,) and param trajectories."""
  params = jax.tree.map(jnp.asarray, params)
  state = optimizer.init(params)

  @jax.jit
  def step(params, state):
    loss, grads = jax.value_and_grad(loss_fn)(params, data)
    updates, state = optimizer.update(grads, state, params)
    return jax.tree.map(jnp.add, params, updates), state, loss

  history = [params]
  losses = []
  for _ in range(steps):
    params, state, loss = step(params, state)
    history.append(params)
    losses.append(loss)
  losses.append(loss_fn(params, data))
  trajectory = {k: np.stack([np.asarray(h[k]) for h in history]) for k in params}
  return dict(loss=np.asarray(losses), **trajectory)


def reference_kron(settings: dict, params: dict):
  """psgd-jax's kron under ``settings``."""
  from psgd_jax.kron import kron, precond_update_prob_schedule

  prob = settings["update_prob"]
  if isinstance(prob, dict):
    prob = precond_update_prob_schedule(**prob)
  return kron(
      learning_rate=settings["learning_rate"],
      b1=settings["b1"],
      preconditioner_update_probability=prob,
      memory_save_mode=settings["memory_save_mode"],
      preconditioner_lr=settings["preconditioner_lr"],
      preconditioner_init_scale=settings["preconditioner_init_scale"],
      scanned_layers=scanned_layers(params, settings["scan_layers"]),
  )


def reference_shampoo(settings: dict):
  """precondition-opt's distributed_shampoo (eigh roots) under ``settings``."""
  from benchmarks.compat import add_removed_names

  add_removed_names()  # jax.tree_map and friends, removed in JAX 0.6
  from precondition import distributed_shampoo as ds

  return ds.distributed_shampoo(
      learning_rate=settings["learning_rate"],
      block_size=settings["block_size"],
      beta1=settings["beta1"],
      beta2=settings["beta2"],
      diagonal_epsilon=settings["epsilon"],
      matrix_epsilon=settings["matrix_epsilon"],
      start_preconditioning_step=settings["start_preconditioning_step"],
      preconditioning_compute_steps=settings["update_preconditioners_freq"],
      graft_type={"rmsprop": ds.GraftingType.RMSPROP, "sgd": ds.GraftingType.SGD}[
          settings["graft_type"]
      ],
      nesterov=True,
      eigh=True,
      best_effort_shape_interpretation=False,
      generate_training_metrics=False,
  )


def main() -> None:
  params, data = make_problem()
  arrays = {f"init/{k}": v for k, v in params.items()}
  arrays.update({f"data/{k}": v for k, v in data.items()})
  for name, settings in KRON_RUNS.items():
    result = run(reference_kron(settings, params), params, data)
    arrays.update({f"{name}/{k}": v for k, v in result.items()})
  for name, settings in SHAMPOO_RUNS.items():
    result = run(reference_shampoo(settings), params, data)
    arrays.update({f"{name}/{k}": v for k, v in result.items()})
  OUTPUT.parent.mkdir(parents=True, exist_ok=True)
  np.savez_compressed(OUTPUT, **arrays)
  for name in [*KRON_RUNS, *SHAMPOO_RUNS]:
    print(f"{name}: loss {arrays[name + '/loss'][0]:.4f} -> {arrays[name + '/loss'][-1]:.4f}")
  print(f"wrote {OUTPUT} ({OUTPUT.stat().st_size} bytes)")


if __name__ == "__main__":
  main()
