"""Optimizers the state-following tests and the benchmarks run, third-party ones included.

psgd-jax 0.2.9 and precondition-opt 0.3.0 are the ``test`` extra
(``pip install -e ".[test]"``), which the benchmarks need too; they import here
after :func:`benchmarks.compat.add_removed_names`. The tests import this module
(``from benchmarks import zoo``); the benchmarks never import ``tests/``.

Example:
  >>> from benchmarks.shapes import llama_params
  >>> zoo = optimizers(llama_params())
  >>> SECOND_ORDER <= set(zoo), len(zoo)
  (True, 15)
"""

import math

import jax
import jax.numpy as jnp
import optax

from benchmarks import compat

compat.add_removed_names()

from precondition import distributed_shampoo as _shampoo  # noqa: E402
from psgd_jax import kron as _kron  # noqa: E402

from trainers import optimizers as _ours  # noqa: E402

LR = 1e-3
# The optimizers with preconditioner factors (the benchmarks add a factors-replicated placement).
SECOND_ORDER = frozenset(
    {"psgd_kron", "distributed_shampoo", "tearfree_layout", "kron", "kron_blocks", "shampoo"}
)


def kernel_labels(params):
  return jax.tree.map(lambda x: "matrix" if len(x.shape) >= 2 else "vector", params)


def scanned_mask(params, scanned: bool):
  return jax.tree_util.tree_map_with_path(
      lambda path, x: scanned and "block" in jax.tree_util.keystr(path), params
  )


def tearfree_layout(block=16):
  """A transformation whose state has tearfree Shampoo's layout: per param ``stats`` and
  ``roots`` lists, one ``(n_blocks, b, b)`` stack per param dim (2-d params only)."""

  def blocks(x):
    r, c = x.shape[-2] // block, x.shape[-1] // block
    return x.reshape(-1, r, block, c, block).transpose(0, 1, 3, 2, 4).reshape(-1, block, block)

  def init_one(p):
    if p.ndim < 2:
      return {"stats": [], "roots": []}
    n = blocks(jnp.zeros(p.shape)).shape[0]
    eye = jnp.broadcast_to(jnp.eye(block), (n, block, block))
    return {
        "stats": [jnp.zeros((n, block, block)) for _ in range(2)],
        "roots": [eye for _ in range(2)],
    }

  def update_one(g, s):
    if g.ndim < 2:
      return s
    b = blocks(g)
    stats = [
        s["stats"][0] + jnp.einsum("nij,nkj->nik", b, b),
        s["stats"][1] + jnp.einsum("nji,njk->nik", b, b),
    ]
    roots = [
        st / (1 + jnp.trace(st, axis1=1, axis2=2)[:, None, None]) + jnp.eye(block) for st in stats
    ]
    return {"stats": stats, "roots": roots}

  def init(params):
    return jax.tree.map(init_one, params)

  def update(grads, state, params=None):
    del params
    is_state = lambda x: isinstance(x, dict) and set(x) == {"stats", "roots"}
    new = jax.tree.map(update_one, grads, state, is_leaf=lambda x: is_state(x))
    return grads, new

  return optax.GradientTransformation(init, update)


def optimizers(params, scanned=False, block_size=64):
  """``{name: GradientTransformation}`` for every optimizer the state tests cover.

  ``block_size`` is distributed_shampoo's block size; the project's shampoo uses half
  of it, the tearfree-layout state a quarter and ``kron_blocks`` twice.
  """
  zoo = {
      "adamw": optax.adamw(LR, weight_decay=0.1, mask=_ours.decay_mask(params)),
      "adafactor": optax.adafactor(LR, min_dim_size_to_factor=32),
      "lion": optax.lion(LR),
      "sgd_momentum": optax.sgd(LR, momentum=0.9),
      "lamb": optax.lamb(LR),
      "muon": optax.contrib.muon(LR),
      "schedule_free": optax.contrib.schedule_free_adamw(LR),
      "chain_clip_masked": optax.chain(
          optax.clip_by_global_norm(1.0),
          optax.masked(optax.add_decayed_weights(0.1), _ours.decay_mask(params)),
          optax.scale_by_adam(),
          optax.scale(-LR),
      ),
      "multi_transform": optax.multi_transform(
          {"matrix": optax.adam(LR), "vector": optax.sgd(LR, momentum=0.9)}, kernel_labels(params)
      ),
      "psgd_kron": _kron.kron(
          LR,
          preconditioner_update_probability=1.0,
          scanned_layers=scanned_mask(params, scanned),
          lax_map_scanned_layers=True,
          lax_map_batch_size=1,
      ),
      # matrix_epsilon 1e-3: inverse 4th roots of near-singular statistics amplify rounding
      # (the order of sharded reductions) past the 1e-5 comparison; this keeps them conditioned.
      "distributed_shampoo": _shampoo.distributed_shampoo(
          LR,
          block_size=block_size,
          start_preconditioning_step=1,
          preconditioning_compute_steps=1,
          matrix_epsilon=1e-3,
      ),
      "tearfree_layout": optax.chain(tearfree_layout(block_size // 4), optax.scale(-LR)),
      "kron": _ours.kron(
          LR, preconditioner_update_probability=1.0, scanned_layers=scanned_mask(params, scanned)
      ),
      "kron_blocks": _ours.kron(
          LR,
          preconditioner_update_probability=1.0,
          scanned_layers=scanned_mask(params, scanned),
          block_size=2 * block_size,
      ),
      "shampoo": _ours.shampoo(LR, block_size=block_size // 2, matrix_epsilon=1e-3),
  }
  return zoo


def train_with(config, optimizer: str):
  """``config`` (changed in place, and returned) training ``optimizer``: a registry name,
  ``<name>:local`` for Kron's or Shampoo's shard-local blocks (``config.optax.blocking``),
  ``<name>:resident`` for every pool of Kron's or SOAP's keeping its state where it runs and
  ``<name>:moved`` for none (``config.optax.resident_padding``; the registry's holds pools
  padded up to 1.5x).

  Example:
    >>> from configs import lm
    >>> config = train_with(lm.get_config(), "kron:local")
    >>> config.optax_name, config.optax.blocking
    ('kron', 'local')
    >>> train_with(lm.get_config(), "soap:resident").optax.resident_padding
    inf
  """
  name, _, variant = optimizer.partition(":")
  config.optax_name = name
  if variant == "local":
    config.optax.blocking = "local"
  if variant in ("resident", "moved"):
    config.optax.resident_padding = math.inf if variant == "resident" else 0.0
  return config
