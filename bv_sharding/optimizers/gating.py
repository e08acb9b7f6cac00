"""Work a step may skip: under ``lax.cond`` where that is safe, else made every step and picked.

The optimizers skip their costly work on the steps that do not need it: Kron's fit, Shampoo's
and SOAP's refreshes. A pool skips moving the factors that work leaves unchanged
(:func:`~bv_sharding.optimizers.pools.run_pool`). Inside ``shard_map`` each device works on
its own arrays, and a ``lax.cond`` there holds no collective. A cond that holds collectives (a
pool's moves, or those XLA puts in work on sharded global arrays) is not safe on XLA:CPU. It
runs a program's independent operations concurrently and keeps its collectives in one order
among themselves, but not with such a cond. So one device can enter the cond's collective while
another waits in one the cond neither reads nor makes, and both wait forever. Big_vision's flow
of Kron on a small ViT did, in 1 of 16 runs (2026-12-05, a pool's write-back under
``lax.cond``). An accelerator runs a device's collectives in the program's one order.

So the skippable work goes under ``lax.cond`` on accelerators, on one device and inside
``shard_map`` (:func:`skips_here`). Elsewhere both sides are made and
``jnp.where`` picks one: the same values (:func:`gated`, :func:`cond`). :func:`skipping`
overrides the choice for what is traced inside it.

Example:
    >>> cond(jnp.bool_(True), lambda x: x + 1, lambda x: x, jnp.ones(2)).tolist()
    [2.0, 2.0]
"""

from __future__ import annotations

import contextlib
import contextvars

import jax
import jax.numpy as jnp
from jax.sharding import AxisType

_SKIPPING = contextvars.ContextVar("skipping", default=None)


@contextlib.contextmanager
def skipping(skip: bool):
  """Within it, work a step may skip is skipped under ``lax.cond`` (``skip`` True) or made on
  every step and picked (False), whatever the devices (:func:`skips_here`). A
  step reads it when it is traced: so an accelerator's step can be compiled, and its bytes and
  FLOPs counted, on CPU devices. Entering and leaving it clear jax's in-memory caches, so that
  no trace made on one side is reused on the other (jax keys its traces by the function, not by
  this choice).

  Example:
      >>> with skipping(True):
      ...   skips_here()
      True
      >>> skips_here()  # 8 CPU devices
      False
  """
  jax.clear_caches()
  token = _SKIPPING.set(skip)
  try:
    yield
  finally:
    _SKIPPING.reset(token)
    jax.clear_caches()


def skips_here() -> bool:
  """Whether work traced here is skipped under ``lax.cond``: inside ``shard_map`` over every
  mesh axis (each device its own arrays, no collective), on accelerators and on one device,
  unless :func:`skipping` says otherwise.

  Example:
      >>> skips_here()  # No mesh, 8 CPU devices: sharded global arrays may need collectives.
      False
  """
  skip = _SKIPPING.get()
  if skip is not None:
    return skip
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.axis_types and all(t == AxisType.Manual for t in mesh.axis_types):
    return True
  return jax.default_backend() != "cpu" or jax.device_count() == 1


def gated(when, make, otherwise=None):
  """``make()``, or, when ``when`` (a boolean scalar, not None) is false, ``otherwise()``
  (default: zeros of ``make``'s shapes) in its place: under ``lax.cond`` where
  :func:`skips_here`, so that the work of ``make`` runs only on the steps that need it, else
  both made and one picked (``jnp.where``), the same values.

  Example:
      >>> gated(jnp.bool_(False), lambda: jnp.ones(2)).tolist(), gated(None, lambda: 1)
      ([0.0, 0.0], 1)
      >>> with skipping(True):
      ...   gated(jnp.bool_(False), lambda: jnp.ones(2)).tolist()
      [0.0, 0.0]
  """
  if when is None:
    return make()
  if otherwise is None:
    otherwise = lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(make))
  if skips_here():
    return jax.lax.cond(when, make, otherwise)
  return jax.tree.map(lambda new, old: jnp.where(when, new, old), make(), otherwise())


def cond(when, true_fn, false_fn, *operands):
  """``jax.lax.cond(when, true_fn, false_fn, *operands)`` where :func:`skips_here`, else both
  functions applied and one result picked by ``when``."""
  return gated(when, lambda: true_fn(*operands), lambda: false_fn(*operands))
