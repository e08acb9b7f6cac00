"""The plain loop the trainer is measured against: it compiles, learns and times its windows."""

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import plain_loop
from configs import lm


def test_the_plain_loop_learns_and_times_each_window():
  config = lm.get_config("size=tiny")
  config.batch_size, config.grad_accum_steps, config.optax_name = 16, 2, "adamw"
  loop = plain_loop.PlainLoop(config)
  assert loop.figures().total > 0
  seconds = loop.window_seconds(2)
  assert len(seconds) == 2 and all(s > 0 for s in seconds)
  assert len(loop.losses) == 3 and loop.losses[0] > loop.losses[1] > loop.losses[2]


def test_microbatches_sum_to_the_whole_batch_gradient():
  loss = lambda w, x: jnp.mean((x @ w) ** 2)
  w, x = jnp.arange(3.0), jnp.arange(24.0).reshape(8, 3) / 10
  whole, split = plain_loop.grads_fn(loss, 1)(w, x), plain_loop.grads_fn(loss, 4)(w, x)
  assert all(np.allclose(a, b, rtol=1e-6) for a, b in zip(whole, split))


def test_state_is_stored_in_the_state_dtype_only_where_it_differs():
  config = lm.get_config("size=tiny")
  config.update(compute_dtype="bfloat16", state_dtype="bfloat16")
  _, opt, _ = plain_loop.PlainLoop(config).abstract()
  dtypes = {leaf.dtype for leaf in jax.tree.leaves(opt) if leaf.ndim}
  assert dtypes == {jnp.dtype("bfloat16")}
