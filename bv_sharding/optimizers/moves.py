"""Reshards that move one run of mesh axes at a time, so that XLA makes each one collective.

Asked to move several mesh axes at once (axes leaving two dims, or a dim's major axis leaving its
minor one), XLA's SPMD partitioner may replicate the array whole and partition it again
("Involuntary full rematerialization"): a ViT's attention kernel and conv embedding on a 4 x 2
mesh did. :func:`axis_steps` lists the specs between two, each one move from the last, and
:func:`move` constrains an array through them (the pools' arrays and factor stacks, Muon's
matrices to their owners and back).

Example:
    >>> axis_steps(("data", None), (None, "data"))
    [(None, 'data')]
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from bv_sharding.ops import stack_axes
from bv_sharding.optimizers.tiles import spec_entry


def move(x: jax.Array, mesh, src: Sequence, dst: Sequence) -> jax.Array:
  """``x`` placed on spec ``src`` (a tuple of entries, one per dim), then resharded to ``dst``
  through :func:`axis_steps` (``with_sharding_constraint`` on ``mesh``; use inside ``jit``).

  Example:
      >>> mesh = jax.make_mesh((2,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
      >>> moved = jax.jit(lambda x: move(x, mesh, ("data", None), (None, "data")))(jax.numpy.ones((4, 4)))
      >>> moved.sharding.spec
      P(None, 'data')
  """
  x = jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(*src)))
  for spec in axis_steps(src, dst):
    x = jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(*spec)))
  return x


def axis_steps(src: Sequence, dst: Sequence) -> list[tuple]:
  """The specs (tuples of entries, one per dim) from ``src`` to ``dst`` that move one run of
  mesh axes at a time: each axis ``dst`` splits a dim by, in ``dst``'s order, added last to
  that dim's axes (taken from the dim that held it, with the axes after it there when ``dst``
  wants them next: an all-to-all; or newly split: a slice), then each axis ``dst`` leaves out
  dropped (an all-gather). XLA's partitioner makes each such step one collective; asked for
  two moves at once (axes leaving two dims, or a dim's major axis leaving its minor one) it
  may replicate the array whole instead ("Involuntary full rematerialization": a ViT's
  attention kernel and conv embedding tiled on a 4 x 2 mesh).

  Example:
      >>> axis_steps((None, "model", "data"), (("data", "model"), None, None))
      [('data', 'model', None), (('data', 'model'), None, None)]
      >>> axis_steps((("data", "model"), None), (None, "model"))
      [('data', 'model'), (None, 'model')]
  """
  current = [list(stack_axes((e,))) for e in src]
  wanted = [list(stack_axes((e,))) for e in dst]
  steps = []
  snapshot = lambda: tuple(spec_entry(axes) for axes in current)
  for dim, axes in enumerate(wanted):
    for i, axis in enumerate(axes):
      if axis in current[dim]:
        continue
      held = next((h for h in current if axis in h), [])
      run = held[held.index(axis) :] if axis in held else [axis]
      if run != axes[i : i + len(run)]:  # Not a minor run of its dim, as dst orders it.
        run = [axis]
      for moved in run:
        if moved in held:
          held.remove(moved)
      current[dim].extend(run)
      steps.append(snapshot())
  for dim, axes in enumerate(current):
    for axis in [a for a in axes if a not in wanted[dim]]:
      axes.remove(axis)
      steps.append(snapshot())
  if not steps or steps[-1] != tuple(spec_entry(a) for a in wanted):
    steps.append(tuple(spec_entry(a) for a in wanted))
  return steps
