"""``config.optax_name`` resolved: a name the library owns, else an optax attribute.

The library's names live in :data:`TRANSFORMATIONS`: big_vision's own
``big_vision.*`` optimizers now, the library's ``bv_sharding.<name>`` ones as they
are added (an entry maps a name to a factory taking ``config.optax``'s keywords).
Any other name is an optax attribute, dotted or not, with or without ``optax.``
(``"scale_by_adam"``, ``"contrib.scale_by_muon"``).

Example:
  >>> import optax
  >>> factory("big_vision.sgd") is optax.identity, factory("optax.scale_by_adam") is optax.scale_by_adam
  (True, True)
  >>> transformation("bv_sharding.scale_by_kronn", {})
  Traceback (most recent call last):
  ...
  bv_sharding.errors.ConfigError: config.optax_name='bv_sharding.scale_by_kronn' is not ...
"""

import inspect
import operator
from collections.abc import Callable, Mapping

import jax.numpy as jnp
import optax

from bv_sharding.errors import ConfigError, closest

__all__ = ["TRANSFORMATIONS", "factory", "momentum_hp", "scale_by_adafactor", "transformation"]

OWN_PREFIXES = ("bv_sharding.", "big_vision.")


def momentum_hp(momentum=0.9, dtype=jnp.bfloat16, nesterov=False) -> optax.GradientTransformation:
  """big_vision's ``momentum_hp``: heavy-ball momentum kept in ``dtype`` (bfloat16).

  Example:
    >>> import jax.numpy as jnp
    >>> state = momentum_hp().init({"w": jnp.ones(2)})
    >>> state.trace["w"].dtype
    dtype(bfloat16)
  """
  return optax.trace(decay=momentum, nesterov=nesterov, accumulator_dtype=dtype)


def scale_by_adafactor(
    min_dim_size_to_factor=32,
    decay_rate=0.8,
    decay_offset=0,
    beta2_cap=0.999,
    clipping_threshold=None,
    momentum=0.9,
    dtype_momentum=jnp.bfloat16,
    eps=1e-30,
) -> optax.GradientTransformation:
  """big_vision's Adafactor: factored second moments whose decay ``1 - t**-decay_rate`` is
  capped at ``beta2_cap``, optional block-RMS clipping, then (undebiased) momentum in
  ``dtype_momentum``.

  Example:
    >>> import jax.numpy as jnp
    >>> state = scale_by_adafactor().init({"w": jnp.ones((64, 32))})
    >>> [s.__class__.__name__ for s in state]
    ['FactoredState', 'EmptyState', 'EmaState']
  """

  def capped_decay(step, exponent):
    return jnp.minimum(beta2_cap, 1.0 - (jnp.asarray(step, jnp.float32) + 1.0) ** (-exponent))

  return optax.chain(
      optax.scale_by_factored_rms(
          factored=True,
          decay_rate=decay_rate,
          step_offset=decay_offset,
          min_dim_size_to_factor=min_dim_size_to_factor,
          epsilon=eps,
          decay_rate_fn=capped_decay,
      ),
      optax.clip_by_block_rms(clipping_threshold) if clipping_threshold else optax.identity(),
      (
          optax.ema(momentum, debias=False, accumulator_dtype=dtype_momentum)
          if momentum
          else optax.identity()
      ),
  )


TRANSFORMATIONS: dict[str, Callable[..., optax.GradientTransformation]] = {
    "big_vision.momentum_hp": momentum_hp,
    "big_vision.scale_by_adafactor": scale_by_adafactor,
    "big_vision.sgd": optax.identity,
}


def factory(name: str) -> Callable[..., optax.GradientTransformation]:
  """The factory ``config.optax_name`` names (see the module docstring).

  Raises:
    ConfigError: a ``bv_sharding.``/``big_vision.`` name the library does not have, or a
      name optax lacks; with the closest known name.
  """
  if name in TRANSFORMATIONS:
    return TRANSFORMATIONS[name]
  own = ", ".join(TRANSFORMATIONS)
  if name.startswith(OWN_PREFIXES):
    raise ConfigError(
        f"config.optax_name={name!r} is not one of the library's transformations "
        f"({own}){closest(name, TRANSFORMATIONS)}"
    )
  path = name.removeprefix("optax.")
  try:
    return operator.attrgetter(path)(optax)
  except AttributeError:
    raise ConfigError(
        f"config.optax_name={name!r} is neither an optax attribute (e.g. 'scale_by_adam') "
        f"nor one of the library's transformations ({own}){closest(path, dir(optax))}"
    ) from None


def transformation(name: str, kwargs: Mapping) -> optax.GradientTransformation:
  """``factory(name)(**kwargs)``: ``config.optax_name`` built with ``config.optax``.

  Raises:
    ConfigError: an unknown name (:func:`factory`), or ``kwargs`` the factory does not
      take (with its signature).
  """
  build = factory(name)
  try:
    inspect.signature(build).bind(**kwargs)
  except TypeError as e:
    raise ConfigError(
        f"config.optax={dict(kwargs)} for config.optax_name={name!r}: {e}. "
        f"Signature: {name.removeprefix('optax.')}{inspect.signature(build)}"
    ) from None
  return build(**kwargs)
