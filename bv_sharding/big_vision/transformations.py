"""``config.optax_name`` resolved: a name the library owns, else an optax attribute.

The library's names live in :data:`TRANSFORMATIONS`: big_vision's own ``big_vision.*``
optimizers and the library's ``bv_sharding.scale_by_kron``, ``bv_sharding.scale_by_shampoo``,
``bv_sharding.scale_by_soap`` and ``bv_sharding.scale_by_muon`` (:mod:`bv_sharding.optimizers`, in the form big_vision's
chain takes: no learning rate, no weight decay). An entry maps a name to a factory taking
``config.optax``'s keywords; a factory with a ``layout`` parameter is also given the
params' :class:`~bv_sharding.optimizers.ParamLayout` (:func:`takes_layout`,
:mod:`~bv_sharding.big_vision.layout`). Any other name is an optax attribute, dotted or
not, with or without ``optax.`` (``"scale_by_adam"``, ``"contrib.scale_by_muon"``).

Example:
  >>> import optax
  >>> factory("big_vision.sgd") is optax.identity, factory("optax.scale_by_adam") is optax.scale_by_adam
  (True, True)
  >>> takes_layout("bv_sharding.scale_by_kron"), takes_layout("scale_by_adam")
  (True, False)
  >>> transformation("bv_sharding.scale_by_kronn", {})
  Traceback (most recent call last):
  ...
  bv_sharding.errors.ConfigError: config.optax_name='bv_sharding.scale_by_kronn' is not ...
"""

import functools
import inspect
import math
import numbers
import operator
from collections.abc import Callable, Mapping

import flax.linen as nn
import jax.numpy as jnp
import optax

from bv_sharding.errors import ConfigError, OptimizerError, closest
from bv_sharding.optimizers import (
    ParamLayout,
    scale_by_kron,
    scale_by_muon,
    scale_by_shampoo,
    scale_by_soap,
)

__all__ = [
    "TRANSFORMATIONS",
    "boxes_unboxed",
    "factory",
    "momentum_hp",
    "mistyped",
    "scale_by_adafactor",
    "takes_layout",
    "transformation",
]

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


def boxes_unboxed(build: Callable[..., optax.GradientTransformation]) -> Callable:
  """``build`` whose transformation's ``init`` takes flax-boxed params, as ``train.py`` gives
  them (``jax.eval_shape(tx.init, params_shape)``, ``jax.jit(tx.init)(params)``); its state
  holds no boxes. Same signature as ``build``.

  Example:
    >>> import jax.numpy as jnp
    >>> boxed = {"w": nn.LogicallyPartitioned(jnp.ones((4, 4)), ("embed", "mlp"))}
    >>> state = boxes_unboxed(scale_by_shampoo)(block_size=2).init(boxed)
    >>> state.per_param["w"].stats[0].shape
    (2, 2, 2, 2)
  """

  @functools.wraps(build)
  def unboxing(*args, **kwargs):
    tx = build(*args, **kwargs)
    return optax.GradientTransformation(lambda params: tx.init(nn.unbox(params)), tx.update)

  return unboxing


TRANSFORMATIONS: dict[str, Callable[..., optax.GradientTransformation]] = {
    "big_vision.momentum_hp": momentum_hp,
    "big_vision.scale_by_adafactor": scale_by_adafactor,
    "big_vision.sgd": optax.identity,
    "bv_sharding.scale_by_kron": boxes_unboxed(scale_by_kron),
    "bv_sharding.scale_by_muon": boxes_unboxed(scale_by_muon),
    "bv_sharding.scale_by_shampoo": boxes_unboxed(scale_by_shampoo),
    "bv_sharding.scale_by_soap": boxes_unboxed(scale_by_soap),
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


def takes_layout(name: str) -> bool:
  """Whether ``config.optax_name``'s factory takes the params' ``layout``.

  Raises:
    ConfigError: an unknown name (:func:`factory`).
  """
  try:
    return "layout" in inspect.signature(factory(name)).parameters
  except (TypeError, ValueError):  # A callable without a signature takes no layout.
    return False


def transformation(name: str, kwargs: Mapping, layout=None) -> optax.GradientTransformation:
  """``factory(name)(**kwargs)``: ``config.optax_name`` built with ``config.optax``, and
  ``layout`` (the params' ``ParamLayout``) where the factory takes one and
  ``config.optax`` does not give it.

  Raises:
    ConfigError: an unknown name (:func:`factory`), ``kwargs`` the factory does not take
      (with its signature), or a value one of the library's optimizers rejects.
  """
  build = factory(name)
  if layout is not None and takes_layout(name) and "layout" not in kwargs:
    kwargs = {**kwargs, "layout": layout}
  try:
    inspect.signature(build).bind(**kwargs)
  except TypeError as e:
    raise ConfigError(
        f"config.optax={_shown(kwargs)} for config.optax_name={name!r}: {e}. "
        f"Signature: {name.removeprefix('optax.')}{inspect.signature(build)}"
    ) from None
  wrong = mistyped(inspect.signature(build), kwargs)
  if wrong:
    raise ConfigError(f"config.optax={_shown(kwargs)} for config.optax_name={name!r}: {wrong}")
  try:
    return build(**kwargs)
  except OptimizerError as e:
    raise ConfigError(
        f"config.optax={_shown(kwargs)} for config.optax_name={name!r}: {e}"
    ) from None


def mistyped(signature: inspect.Signature, kwargs: Mapping) -> str | None:
  """What is wrong with the first of ``kwargs`` whose value does not fit ``signature``: not a
  number where the default or the annotation is one (a string from the command line,
  ``--config.optax.b1=abc``, or NaN; an infinite bound such as ``resident_padding=inf`` is a
  number; None where the default or the annotation allows it), not an integer where an ``int``
  is asked, or not a pair of finite numbers where the default is a pair; None: nothing.

  Example:
    >>> mistyped(inspect.signature(optax.scale_by_adam), {"b1": "abc"})
    "b1='abc' is not a number (the default is 0.9)"
    >>> mistyped(inspect.signature(scale_by_soap), {"betas": 0.9})
    'betas=0.9 must be 2 finite numbers, like (0.95, 0.95)'
  """
  for arg, value in kwargs.items():
    parameter = signature.parameters.get(arg)
    problem = None if parameter is None else _misfit(value, parameter)
    if problem:
      return f"{arg}={value!r} {problem}"
  return None


def _misfit(value, parameter: inspect.Parameter) -> str | None:
  default, wanted = parameter.default, _wanted(parameter)
  if wanted == "pair":
    finite = isinstance(value, (tuple, list)) and all(map(_is_finite, value))
    if not finite or len(value) != len(default):
      return f"must be {len(default)} finite numbers, like {default!r}"
  optional = default is None or str(parameter.annotation).endswith("| None")
  if wanted not in ("int", "number") or (value is None and optional):
    return None
  if not _is_number(value) or value != value:
    return f"is not a number (the default is {default!r})"
  if wanted == "int" and not isinstance(value, numbers.Integral):
    return f"must be an integer (the default is {default!r})"
  return None


def _wanted(parameter: inspect.Parameter) -> str | None:
  """ "pair", "int", "number" or None: what ``parameter``'s default or annotation asks for."""
  default, annotation = parameter.default, parameter.annotation
  text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", "")
  if isinstance(default, tuple) and default and all(map(_is_number, default)):
    return "pair"
  if text in ("float", "float | None"):
    return "number"
  if text in ("int", "int | None") or (
      not text and isinstance(default, int) and _is_number(default)
  ):
    return "int"
  return "number" if _is_number(default) else None


def _is_finite(x) -> bool:
  return _is_number(x) and math.isfinite(x)


def _is_number(x) -> bool:
  return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _shown(kwargs: Mapping) -> dict:
  """``kwargs`` as the config wrote them (the layout given here left out)."""
  return {k: v for k, v in kwargs.items() if not isinstance(v, ParamLayout)}
