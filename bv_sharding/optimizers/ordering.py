"""Collectives put in one order by data: pools' conditional moves on XLA:CPU's devices.

XLA:CPU runs a step's independent operations concurrently, and orders its collectives only
among themselves: a ``lax.cond`` that holds collectives (a pool's gated moves:
:func:`~bv_sharding.optimizers.pools.gated`) may start on one device before another
collective and after it on another, and both wait forever (big_vision's flow of Kron on a small
ViT deadlocked so in 1 of 16 fresh runs, 2026-12-05). :func:`token` is a zero that exists only
once some arrays do, computed on each device from its own shards (no collective), and
:func:`after` makes a value (a cond's predicate, a pool's inputs) wait for it; the value is
unchanged. Chained through the pools, every gated move runs between the same collectives on
every device.

Example:
    >>> mesh = jax.make_mesh((2,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    >>> x = jax.device_put(jnp.arange(4.0), jax.sharding.NamedSharding(mesh, P("data")))
    >>> t = jax.jit(lambda x: token([x], [("data",)], mesh))(x)
    >>> int(t), after({"w": jnp.ones(2)}, t)["w"].tolist()
    (0, [1.0, 1.0])
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P


def token(xs: Sequence[jax.Array], specs: Sequence[tuple], mesh) -> jax.Array | None:
  """An int32 zero that depends on every array of ``xs`` (each sharded as its entry of
  ``specs``, a tuple of entries per dim), read on each device from its own shards; None
  without arrays."""
  pairs = [(x, spec) for x, spec in zip(xs, specs) if x.size]
  if not pairs:
    return None

  def local(*shards):
    zero = jnp.zeros((), jnp.int32)
    for shard in shards:
      if shard.size:  # Its first number's bits, made zero in a way XLA does not fold.
        bits = jax.lax.bitcast_convert_type(shard.reshape(-1)[0].astype(jnp.float32), jnp.int32)
        zero = zero + jnp.minimum(bits & 0x7FFFFFFF, 0)
    return zero

  in_specs = tuple(P(*spec) for _, spec in pairs)
  run = jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=P(), check_vma=False)
  return run(*[x for x, _ in pairs])


def after(tree, zero: jax.Array | None):
  """``tree``'s arrays unchanged, each computed only once ``zero`` (a :func:`token`) is; the
  tree as it is for None."""
  if zero is None:
    return tree
  wait = lambda x: jnp.where(zero == 0, x, jnp.zeros_like(x))
  return jax.tree.map(lambda x: wait(x) if isinstance(x, jax.Array) else x, tree)
