"""A stack of tiles as its devices' pieces, whatever dims the mesh axes split.

A tile stack ``(K, *tile)`` whose tile dims are split over some mesh axes (``entries``, one per
tile dim) is, read another way, ``(K, N, width)``: for each tile, the piece each of the ``N``
devices of ``axes`` holds (flat, in a fixed order), dim 1 split over ``axes`` in their order.
The view is a reshape and a transpose that keep every element on its device, so stacks of
differently split tiles join one array that reaches whole tiles on each device in one
all-to-all (:func:`~bv_sharding.optimizers.pools.run_pool`). An axis of ``axes`` that splits no
tile dim cuts each device's share of the rest (padded to a multiple of its size), a slice of
what every device of that axis holds alike.

Example:
    >>> layout = Layout((4, 6), (None, "data"), ("data",), (("data", 2),))
    >>> tiles = jnp.arange(48.0).reshape(2, 4, 6)
    >>> pieces = to_pieces(tiles, layout)  # Each tile's columns 0-2, then its columns 3-5.
    >>> pieces.shape, pieces[0, 1, :3].tolist()
    ((2, 2, 12), [3.0, 4.0, 5.0])
    >>> bool((from_pieces(pieces, layout) == tiles).all())
    True
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from bv_sharding.ops import stack_axes


class Layout(NamedTuple):
  """How a tile stack is split: the tile's shape, each tile dim's spec entry, the axes its
  pieces are dealt over (in order) and the mesh's axis sizes (``((name, size), ...)``)."""

  tile: tuple[int, ...]
  entries: tuple
  axes: tuple[str, ...]
  sizes: tuple[tuple[str, int], ...]

  @property
  def _split(self) -> tuple[list[int], list[str | None]]:
    """The tile's dims, each cut into its axes' sizes (``labels``: the axis) then the rest
    (``None``); an axis not in :attr:`axes` (of size 1) cuts nothing."""
    sizes, shape, labels = dict(self.sizes), [], []
    for extent, entry in zip(self.tile, self.entries):
      axes = [a for a in stack_axes((entry,)) if a in self.axes]
      shape += [sizes[a] for a in axes] + [extent // math.prod(sizes[a] for a in axes)]
      labels += [*axes, None]
    return shape, labels

  @property
  def _missing(self) -> list[str]:
    """The axes of :attr:`axes` that split no tile dim."""
    return [a for a in self.axes if a not in self._split[1]]

  @property
  def _rest(self) -> int:
    """The elements of a device's piece before the missing axes cut it."""
    shape, labels = self._split
    return math.prod(n for n, label in zip(shape, labels) if label is None)

  @property
  def width(self) -> int:
    """A piece's elements (the rest, padded to a multiple of the missing axes, cut by them)."""
    return -(-self._rest // math.prod(dict(self.sizes)[a] for a in self._missing))


def to_pieces(tiles: jax.Array, layout: Layout, width: int | None = None) -> jax.Array:
  """``tiles`` ``(K, *layout.tile)`` as ``(K, N, width)`` (``width``: at least
  :attr:`Layout.width`; the pieces zero-padded to it). Pure reshapes, transposes and padding:
  on global arrays inside ``jit`` and on a device's own ones alike."""
  shape, labels = layout._split
  sizes, missing = dict(layout.sizes), layout._missing
  count = tiles.shape[0]
  present = [i for i, label in enumerate(labels) if label is not None]
  rest = [i for i, label in enumerate(labels) if label is None]
  x = tiles.reshape(count, *shape).transpose(0, *[1 + i for i in [*present, *rest]])
  x = x.reshape(count, *[shape[i] for i in present], layout._rest)
  own = layout.width * math.prod(sizes[a] for a in missing)
  x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, own - layout._rest)])
  x = x.reshape(count, *[shape[i] for i in present], *[sizes[a] for a in missing], layout.width)
  order = [labels[i] for i in present] + missing
  x = x.transpose(0, *[1 + order.index(a) for a in layout.axes], x.ndim - 1)
  x = x.reshape(count, math.prod(sizes[a] for a in layout.axes), layout.width)
  return jnp.pad(x, [(0, 0), (0, 0), (0, (width or layout.width) - layout.width)])


def from_pieces(pieces: jax.Array, layout: Layout) -> jax.Array:
  """Inverse of :func:`to_pieces`: ``(K, N, width)`` back to ``(K, *layout.tile)``."""
  shape, labels = layout._split
  sizes, missing = dict(layout.sizes), layout._missing
  count = pieces.shape[0]
  present = [i for i, label in enumerate(labels) if label is not None]
  rest = [i for i, label in enumerate(labels) if label is None]
  x = pieces[..., : layout.width].reshape(count, *[sizes[a] for a in layout.axes], layout.width)
  order = [labels[i] for i in present] + missing
  x = x.transpose(0, *[1 + layout.axes.index(a) for a in order], x.ndim - 1)
  x = x.reshape(count, *[shape[i] for i in present], -1)[..., : layout._rest]
  x = x.reshape(count, *[shape[i] for i in [*present, *rest]])
  inverse = sorted(range(len(shape)), key=[*present, *rest].__getitem__)
  return x.transpose(0, *[1 + i for i in inverse]).reshape(count, *layout.tile)
