"""Muon's ``adam_leaves``: the input embedding and the output head train with Adam by default,
hidden matrices with Newton-Schulz; ``adam_leaves=""`` orthogonalises every matrix again."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import bv_sharding as bvs
from bv_sharding.errors import OptimizerError
from bv_sharding.optimizers import muon, scale_by_muon

STEPS = 2


def _leaves():
  """Three matrices under names no pattern matches."""
  keys = iter(jax.random.split(jax.random.PRNGKey(0), 3))
  return {
      "table": jax.random.normal(next(keys), (32, 8)),  # vocab x width
      "logits": jax.random.normal(next(keys), (8, 32)),
      "hidden": jax.random.normal(next(keys), (2, 8, 16)),  # a scanned stack of 2 layers
  }


def _llama(leaves):
  """The leaves under a Llama's names (embed/embedding, lm_head/kernel, a hidden kernel)."""
  return {
      "embed": {"embedding": leaves["table"]},
      "lm_head": {"kernel": leaves["logits"]},
      "layers": {"mlp": {"up_kernel": leaves["hidden"]}},
  }


def _unnamed(tree):
  """A :func:`_llama` tree (of params or updates) as :func:`_leaves` names its leaves."""
  up = tree["layers"]["mlp"]["up_kernel"]
  return {"table": tree["embed"]["embedding"], "logits": tree["lm_head"]["kernel"], "hidden": up}


def _updates(tx, params, grads=None) -> list:
  """The updates of :data:`STEPS` steps of ``tx`` on gradients ``sin(k * params)`` (or ``grads``),
  in one compiled program."""

  @jax.jit
  def run(params, grads):
    state, out = tx.init(params), []
    for k in range(1, STEPS + 1):
      g = jax.tree.map(lambda p, k=k: jnp.sin(k * p), params) if grads is None else grads
      updates, state = tx.update(g, state, params)
      out.append(updates)
    return out

  return run(params, grads)


def _close(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-4)  # float32, batched apart


def test_embedding_and_head_take_adam_and_hidden_kernels_newton_schulz():
  leaves = _leaves()
  llama = [_unnamed(u) for u in _updates(scale_by_muon(), _llama(leaves))]
  adam = _updates(optax.scale_by_adam(eps=1e-8, nesterov=True), leaves)
  orthogonalised = _updates(scale_by_muon(), leaves)
  for step in range(STEPS):
    _close(llama[step]["table"], adam[step]["table"])
    _close(llama[step]["logits"], adam[step]["logits"])
    _close(llama[step]["hidden"], orthogonalised[step]["hidden"])
  assert not np.allclose(orthogonalised[0]["hidden"], adam[0]["hidden"], rtol=0.1)
  state = muon(0.02).init(_llama(leaves)).inner_states
  assert isinstance(state["muon"].inner_state[0].mu["embed"]["embedding"], optax.MaskedNode)
  assert state["adam"].inner_state[0].mu["lm_head"]["kernel"].shape == (8, 32)  # Adam's moment


def test_an_empty_pattern_orthogonalises_the_embedding_and_head_again():
  leaves = _leaves()
  llama = _updates(muon(0.02, adam_leaves=""), _llama(leaves))
  _close([_unnamed(u) for u in llama], _updates(muon(0.02), leaves))


def test_a_vit_patch_embedding_and_head_take_adam_its_attention_kernels_do_not():
  dims = bvs.optimizers.matrix_dims(
      {
          "embedding": {"kernel": jnp.ones((4, 4, 3, 8))},
          "pos_embedding": jnp.ones((1, 16, 8)),
          "head": {"kernel": jnp.ones((8, 10))},
          "MultiHeadDotProductAttention_0": {"query": {"kernel": jnp.ones((8, 2, 4))}},
      }
  )
  assert dims["embedding"]["kernel"] is None and dims["head"]["kernel"] is None
  assert dims["pos_embedding"] is None
  assert dims["MultiHeadDotProductAttention_0"]["query"]["kernel"] is not None


def test_weight_decay_reaches_the_embedding_in_the_adam_branch_not_the_biases():
  params = {**_llama(_leaves()), "bias": jnp.ones(8)}
  zero = jax.tree.map(jnp.zeros_like, params)  # Adam's and Muon's directions are then 0.
  updates = _updates(muon(0.5, weight_decay=0.1), params, zero)[0]
  _close(updates["embed"], jax.tree.map(lambda p: -0.05 * p, params["embed"]))
  np.testing.assert_array_equal(updates["bias"], 0.0)


def test_a_pattern_that_is_no_regex_is_refused_with_the_fix():
  with pytest.raises(OptimizerError, match=r"adam_leaves='\('.*regular expression.*''"):
    muon(0.02, adam_leaves="(")
