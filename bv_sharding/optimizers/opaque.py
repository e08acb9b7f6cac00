"""Indices XLA cannot see: like members of a stack read at them compile to one kernel.

A pool's results (or Muon's owners') come back as one stack per group of like params, and each
param's update and state are cut from it. ``stack[j]`` bakes the offset ``j`` into the kernel of
every consumer of that slice (XLA fuses the slice into each), so each param costs kernels of its
own, however alike the params are: in a Llama's train step on 8 devices, 210 of Kron's 570
kernels, and XLA:CPU compiles a kernel in about 20 ms. Read at an index that is data
(``lax.dynamic_index_in_dim``), the consumers of like members are one kernel: that step
compiles 360 kernels. Where the stack is a loop's own making, :func:`apart` leaves its members
apart instead, and needs no mesh.

Example:
    >>> mesh = jax.sharding.Mesh(jax.devices()[:1], ("data",))
    >>> [int(i) for i in jax.jit(lambda: indices(3, mesh))()]
    [0, 1, 2]
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P


def indices(count: int, mesh: jax.sharding.Mesh) -> list[jax.Array]:
  """The int32 scalars ``0, ..., count - 1``, as values XLA cannot fold into the kernels that
  read them: they go through one loop whose trip count XLA cannot know (0 on the first device
  of ``mesh``, 1 on the others), and which leaves them as they are (``max(j, 0)``)."""
  axes = tuple(mesh.axis_names)
  trips = jax.shard_map(
      lambda: jnp.minimum(jax.lax.axis_index(axes), 1),
      mesh=mesh,
      in_specs=(),
      out_specs=P(),
      check_vma=False,
  )()
  step = lambda carry: (carry[0] - 1, [jnp.maximum(i, 0) for i in carry[1]])
  start = (trips, [jnp.int32(j) for j in range(count)])
  return jax.lax.while_loop(lambda carry: carry[0] > 0, step, start)[1]


def member(stack: jax.Array, index: jax.Array) -> jax.Array:
  """``stack[index]`` (dim 0), read at an index from :func:`indices`."""
  return jax.lax.dynamic_index_in_dim(stack, index, keepdims=False, allow_negative_indices=False)


def apart(fn, count: int, like: jax.ShapeDtypeStruct) -> tuple[jax.Array, ...]:
  """``fn(j)`` for each ``j < count`` (each like ``like``), each its own array, ``fn`` compiled
  once: a loop computes one a turn at its counter and shifts its carry along, so the results
  leave it as separate arrays, with no stack to slice at constant offsets. ``count`` copies a
  turn: for small members, or where ``fn`` costs far more than a copy (a random draw).

  Example:
      >>> like = jax.ShapeDtypeStruct((2,), jnp.int32)
      >>> [int(x[0]) for x in jax.jit(lambda: apart(lambda j: jnp.full(2, j), 3, like))()]
      [0, 1, 2]
  """
  turn = lambda j, done: done[1:] + (fn(j),)
  start = tuple(jnp.zeros(like.shape, like.dtype) for _ in range(count))
  return jax.lax.fori_loop(0, count, turn, start)
