"""Optimizer state stored in one dtype (``config.state_dtype``) and updated in float32.

:func:`with_state_dtype` wraps any optax transformation, the project's optimizers and
big_vision's ``optax_name`` chains alike. Its ``init`` stores every floating-point state
array in the dtype the optimizer itself gives it for params of ``dtype``: the state that
follows the params (Adam's moments, Adafactor's factors, Lion's and SGD's momentum, Kron's
momentum and Qs, Shampoo's statistics, roots and graft moments, Muon's momentum,
schedule-free's ``z``) is stored in ``dtype``, and what an optimizer's own argument fixes
(``config.optax.mu_dtype``, Kron's ``precond_dtype``) keeps that dtype, so such a key wins
for what it names. Integer counters and 0-d arrays (step counts, schedule-free's weight sum,
injected hyper-parameters) keep their dtype: exact, and they weigh nothing.

Its ``update`` casts the gradients, the params and the state up to float32, runs the
optimizer there (Shampoo's statistics and ``eigh`` roots, Kron's factor fits, Newton-Schulz,
the moment updates: every delicate computation is float32 whatever the storage) and casts
the new state back to the dtypes it was stored in, and the updates to the gradients' dtype
(as optax's own transformations return them: no float32 copy of the params' size outlives
the update). The casts are elementwise and XLA fuses
them into their consumers; an array already in its dtype is passed through untouched, so a
float32 run is bit-identical with or without the wrapper. An EMA step smaller than the
storage's resolution (``2**-8`` relative in bfloat16, e.g. ``beta2=0.999``'s) is rounded
away: that is the price of bfloat16 second moments, as in every implementation that offers them.

Example:
  >>> import jax.numpy as jnp
  >>> import optax
  >>> tx = with_state_dtype(optax.adam(1e-3, mu_dtype="float32"), "bfloat16")
  >>> params = {"w": jnp.ones((4, 4))}
  >>> state = tx.init(params)
  >>> state[0].count.dtype, state[0].mu["w"].dtype, state[0].nu["w"].dtype  # mu_dtype wins
  (dtype('int32'), dtype('float32'), dtype(bfloat16))
  >>> updates, state = tx.update(params, state, params)
  >>> updates["w"].dtype, state[0].nu["w"].dtype
  (dtype('float32'), dtype(bfloat16))
"""

import jax
import jax.numpy as jnp
import optax


def with_state_dtype(tx: optax.GradientTransformation, dtype) -> optax.GradientTransformation:
  """``tx`` with its floating-point state stored in ``dtype`` and updated in float32.

  The state keeps ``tx``'s tree structure, so plans, checkpoints and the layout's block
  stacks see the same leaves (see the module docstring).
  """

  def init(params):
    stored = jax.eval_shape(tx.init, jax.tree.map(lambda p: _abstract(p, dtype), params))
    return jax.tree.map(_store, tx.init(params), stored)

  def update(updates, state, params=None):
    up = lambda tree: jax.tree.map(lambda x: _cast(x, compute_dtype(x.dtype)), tree)
    new, new_state = tx.update(up(updates), up(state), None if params is None else up(params))
    back = lambda tree, like: jax.tree.map(lambda n, o: _cast(n, o.dtype), tree, like)
    return back(new, updates), back(new_state, state)

  return optax.GradientTransformation(init, update)


def compute_dtype(dtype) -> jnp.dtype:
  """The dtype an optimizer updates an array of ``dtype`` in: float32 for narrower floats.

  Example:
    >>> compute_dtype(jnp.bfloat16), compute_dtype(jnp.int32)
    (dtype('float32'), dtype('int32'))
  """
  if jnp.issubdtype(dtype, jnp.floating):
    return jnp.promote_types(dtype, jnp.float32)
  return jnp.dtype(dtype)


def _cast(x, dtype):
  """``x`` as ``dtype`` if it is a floating-point array of another dtype, else ``x`` itself."""
  if not jnp.issubdtype(x.dtype, jnp.floating) or x.dtype == jnp.dtype(dtype):
    return x
  return x.astype(dtype)


def _abstract(x, dtype) -> jax.ShapeDtypeStruct:
  """The shape of ``x`` in ``dtype`` if it is floating-point (nothing is computed)."""
  floating = jnp.issubdtype(x.dtype, jnp.floating)
  return jax.ShapeDtypeStruct(x.shape, dtype if floating else x.dtype)


def _store(x, stored):
  """``x`` in the dtype of ``stored`` (its abstract twin), but 0-d arrays as they are."""
  return x if x.ndim == 0 else _cast(x, stored.dtype)
