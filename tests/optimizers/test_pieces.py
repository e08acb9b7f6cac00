"""A tile stack seen as its devices' pieces: the view is exact (its inverse gives the tiles
back) and local (on a 4 x 2 mesh each device's piece is its own shard's elements, the view
compiles to no collective, and the pieces of all devices hold every element once), whatever
dims the mesh axes split, in either order, with axes that split no dim and pieces padded.
Library imports only."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import bv_sharding as bvs
from bv_sharding.optimizers.pieces import Layout, from_pieces, to_pieces

AXES, SIZES = ("data", "model"), (("data", 4), ("model", 2))
COLLECTIVES = ("all-to-all", "all-gather", "all-reduce", "collective-permute", "reduce-scatter")
LAYOUTS = [
    ((16, 8), (None, ("data", "model"))),  # Both axes on the columns.
    ((16, 8), ("model", "data")),  # One on each dim, against the mesh's order.
    ((16, 8), (("model", "data"), None)),  # Both on the rows, the minor one first.
    ((16, 8), ("data", None)),  # "model" splits no dim: it cuts the rest.
    ((12, 6), ("data", None)),  # ... of 3 x 6 elements: padded to 2 x 9.
    ((3,), (None,)),  # No axis splits it: 3 elements in 8 pieces of one, 5 of them padding.
    ((2, 4, 8), (None, "model", "data")),  # A layer's dim first (a scanned stack's tiles).
]


@pytest.mark.parametrize("tile, entries", LAYOUTS)
def test_pieces_are_each_devices_own_elements_and_give_the_tiles_back(tile, entries):
  mesh = bvs.make_mesh([("data", 4), ("model", 2)], axis_types="auto")
  layout = Layout(tile, entries, AXES, SIZES)
  count = 3
  tiles = jnp.arange(1, 1 + count * np.prod(tile), dtype=jnp.float32).reshape(count, *tile)
  placed = jax.device_put(tiles, NamedSharding(mesh, P(None, *entries)))
  view = jax.jit(
      lambda x: jax.lax.with_sharding_constraint(
          to_pieces(x, layout, layout.width + 2), NamedSharding(mesh, P(None, AXES, None))
      )
  )
  assert not [c for c in COLLECTIVES if c in view.lower(placed).compile().as_text()]
  pieces = view(placed)
  assert pieces.shape == (count, 8, layout.width + 2)
  seen = []
  for shard in pieces.addressable_shards:
    [own] = [s for s in placed.addressable_shards if s.device == shard.device]
    values = np.asarray(shard.data).ravel()
    values = values[values != 0]  # Padding.
    assert set(values) <= set(np.asarray(own.data).ravel()), shard.device
    seen.extend(values)
  assert sorted(seen) == list(np.asarray(tiles).ravel())
  assert bool((from_pieces(pieces, layout) == tiles).all())
  assert bool((from_pieces(to_pieces(tiles, layout), layout) == tiles).all())  # Off the mesh.


def test_a_size_one_axis_in_a_spec_cuts_nothing():
  layout = Layout((8, 4), (("data", "pipe"), None), ("data",), (("data", 4), ("pipe", 1)))
  tiles = jnp.arange(64.0).reshape(2, 8, 4)
  assert to_pieces(tiles, layout).shape == (2, 4, 8)
  assert bool((from_pieces(to_pieces(tiles, layout), layout) == tiles).all())
