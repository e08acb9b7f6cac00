"""Matmul FLOPs of a traced program, every scanned layer counted: a walk over its jaxpr.

XLA's ``cost_analysis()`` counts a loop's body once, so a model whose layers run in a
``lax.scan`` (``scan_layers=True``) or a step over microbatches is undercounted by the trip
count. :func:`matmul_flops` counts the program as traced instead: each ``dot_general`` is
2 FLOPs per multiply-add, each ``conv_general_dilated`` likewise, and it recurses into every
sub-program an equation holds (``jit``, ``remat``, ``custom_jvp_call``, ``custom_vjp_call``
...), with these rules:

* ``scan``: its body times its ``length``;
* ``cond``: its costliest branch;
* ``while``: its body and condition once (the trip count is not known when traced);
* ``shard_map``: the per-shard body times the number of shards of its newly manual axes.

Elementwise work (softmax, norms, activations) is not counted: these are "matmul FLOPs",
the count MFU is made of (PaLM, appendix B). Nothing is compiled: tracing a 1B model's step
takes seconds. A kernel that hides its matmuls from the jaxpr (a custom call) counts 0.

Example:
  >>> import jax, jax.numpy as jnp
  >>> w = jnp.ones((32, 16))
  >>> layer = lambda x, _: (jnp.tanh(x @ w @ w.T), None)
  >>> scanned = lambda x: jax.lax.scan(layer, x, length=4)[0]
  >>> x = jax.ShapeDtypeStruct((64, 32), jnp.float32)
  >>> traced_flops(scanned, x) == 4 * 2 * (2 * 64 * 32 * 16)  # 4 layers of 2 matmuls
  True
"""

import math
from collections.abc import Callable

import jax
from jax.extend import core


def matmul_flops(jaxpr) -> float:
  """The matmul FLOPs of a ``Jaxpr`` or ``ClosedJaxpr``, its sub-programs included (module
  docstring's rules).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> matmul_flops(jax.make_jaxpr(lambda a, b: a @ b)(jnp.ones((4, 3)), jnp.ones((3, 2))))
    48.0
  """
  jaxpr = getattr(jaxpr, "jaxpr", jaxpr)  # A ClosedJaxpr's own.
  return float(sum(_equation_flops(e) for e in jaxpr.eqns))


def traced_flops(fn: Callable, *args) -> float:
  """The matmul FLOPs of ``jax.jit(fn)`` traced on ``args`` (arrays or ``ShapeDtypeStruct``s,
  their shardings kept); see the module example. Call it under the mesh and logical rules
  ``fn`` runs under."""
  return matmul_flops(jax.jit(fn).trace(*args).jaxpr)


def _equation_flops(eqn) -> float:
  name, params = eqn.primitive.name, eqn.params
  if name == "dot_general":
    return _dot_flops(eqn)
  if name == "conv_general_dilated":
    return _conv_flops(eqn)
  if name == "scan":
    return params["length"] * matmul_flops(params["jaxpr"])
  if name == "cond":
    return max(matmul_flops(b) for b in params["branches"])
  if name == "shard_map":
    shards = math.prod(params["mesh"].shape[a] for a in params["newly_manual_axes"])
    return shards * matmul_flops(params["jaxpr"])
  return sum(matmul_flops(j) for j in _sub_jaxprs(params))  # while, jit, remat, custom_*.


def _sub_jaxprs(params: dict) -> list:
  """The jaxprs an equation's params hold (directly or in a tuple)."""
  found = []
  for value in params.values():
    for v in value if isinstance(value, tuple | list) else (value,):
      if isinstance(v, core.Jaxpr | core.ClosedJaxpr):
        found.append(v)
  return found


def _dot_flops(eqn) -> float:
  """2 per multiply-add: 2 x every lhs element x the rhs's free (non-contracted, non-batch) size."""
  lhs, rhs = (v.aval.shape for v in eqn.invars)
  (_, rhs_contract), (_, rhs_batch) = eqn.params["dimension_numbers"]
  rhs_free = [d for i, d in enumerate(rhs) if i not in (*rhs_contract, *rhs_batch)]
  return 2.0 * math.prod(lhs) * math.prod(rhs_free)


def _conv_flops(eqn) -> float:
  """2 per multiply-add: each output element sums over the kernel's input features and window."""
  (out,), rhs = eqn.outvars, eqn.invars[1].aval.shape
  out_features = rhs[eqn.params["dimension_numbers"].rhs_spec[0]]
  return 2.0 * math.prod(out.aval.shape) * math.prod(rhs) / out_features
