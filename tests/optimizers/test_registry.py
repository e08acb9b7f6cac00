"""Registry: names, argument errors, schedules, weight-decay mask, every optimizer."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from trainers.optimizers import (
    OPTIMIZERS,
    OptimizerError,
    decay_mask,
    make_optimizer,
    make_schedule,
)


def llama_like_params(layers: int = 2, dim: int = 16, vocab: int = 32) -> dict:
  """A tiny Llama-shaped param dict; blocks are stacked on a leading layer axis."""
  key = iter(jax.random.split(jax.random.PRNGKey(0), 16))
  normal = lambda *shape: 0.1 * jax.random.normal(next(key), shape)
  return {
      "embed": {"embedding": normal(vocab, dim)},
      "blocks": {
          "attn_norm": {"scale": jnp.ones((layers, dim))},
          "attn": {name: {"kernel": normal(layers, dim, dim)} for name in "qkvo"},
          "mlp_norm": {"scale": jnp.ones((layers, dim))},
          "mlp": {
              "up": {"kernel": normal(layers, dim, 2 * dim)},
              "down": {"kernel": normal(layers, 2 * dim, dim)},
          },
      },
      "final_norm": {"scale": jnp.ones(dim)},
      "head": {"kernel": normal(dim, vocab), "bias": jnp.zeros(vocab)},
  }


def test_unknown_name_lists_choices_and_closest_match():
  with pytest.raises(OptimizerError) as err:
    make_optimizer("shampo", 1e-3)
  message = str(err.value)
  assert "did you mean 'shampoo'?" in message
  assert all(name in message for name in OPTIMIZERS)
  assert isinstance(err.value, ValueError)


def test_bad_argument_shows_signature():
  with pytest.raises(OptimizerError, match=r"kron\(learning_rate.*preconditioner_lr") as err:
    make_optimizer("kron", 1e-3, precond_lr=0.1)
  assert "did you mean 'preconditioner_lr'?" in str(err.value)
  with pytest.raises(OptimizerError, match=r"Signature: adamw\(learning_rate"):
    make_optimizer("adamw", 1e-3, beta1=0.9)


def test_weight_decay_goes_through_make_optimizer_arguments():
  with pytest.raises(OptimizerError, match="weight_decay_mask"):
    make_optimizer("adamw", 1e-3, mask=lambda p: p)


def test_bad_decay_name():
  with pytest.raises(OptimizerError, match="cosine"):
    make_schedule(1.0, 10, decay_type="exp")


@pytest.mark.parametrize(
    "schedule, expected",
    [
        (dict(decay_type="cosine"), [0.0, 2.0, 1.0, 0.0]),
        (dict(decay_type="linear", linear_end=0.1), [0.0, 2.0, 1.1, 0.2]),
        (dict(decay_type="stair"), [0.0, 2.0, 2.0, 2.0]),
    ],
)
def test_schedule_warmup_then_decay(schedule, expected):
  sched = make_schedule(2.0, 110, warmup_steps=10, **schedule)
  values = [float(sched(step)) for step in (0, 10, 60, 110)]
  np.testing.assert_allclose(values, expected, atol=1e-6)


def test_decay_mask_skips_norms_biases_and_vectors():
  mask = decay_mask(llama_like_params())
  assert mask["head"] == {"kernel": True, "bias": False}
  assert mask["blocks"]["attn_norm"]["scale"] is False
  assert mask["final_norm"]["scale"] is False
  assert mask["blocks"]["mlp"]["up"]["kernel"] is True


def test_weight_decay_respects_mask_and_clipping_applies():
  params = {"w": jnp.ones((2, 2)), "ln": {"scale": jnp.ones(2)}}
  zero = jax.tree.map(jnp.zeros_like, params)
  tx = make_optimizer("sgd", 1.0, weight_decay=0.5, momentum=0.0)
  updates, _ = tx.update(zero, tx.init(params), params)
  np.testing.assert_allclose(updates["w"], -0.5)
  np.testing.assert_allclose(updates["ln"]["scale"], 0.0)
  big = jax.tree.map(lambda p: 100.0 * jnp.ones_like(p), params)
  tx = make_optimizer("sgd", 1.0, clip_norm=1.0, momentum=0.0)
  updates, _ = tx.update(big, tx.init(params), params)
  assert np.isclose(float(optax.global_norm(updates)), 1.0, rtol=1e-5)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_every_optimizer_updates_llama_like_params(name):
  params = llama_like_params()
  grads = jax.tree.map(lambda p: jnp.full_like(p, 0.01) + 0.1 * p, params)
  tx = make_optimizer(
      name,
      1e-2,
      weight_decay=0.1,
      clip_norm=1.0,
      schedule=dict(total_steps=10, warmup_steps=2),
  )
  state = tx.init(params)
  step = jax.jit(tx.update)
  for _ in range(3):
    updates, state = step(grads, state, params)
    params = optax.apply_updates(params, updates)
  assert jax.tree.structure(updates) == jax.tree.structure(params)
  assert all(bool(jnp.isfinite(u).all()) for u in jax.tree.leaves(updates))
  assert float(optax.global_norm(updates)) > 0
