"""Kron's probes drawn tile by tile: a pool draws its members' tiles where it fits them, each
device its own, with no collective, and they are the tiles of the probe drawn whole (padding
zero); a param of one tile draws psgd-jax's probe. Library imports only."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from bv_sharding.optimizers.draws import TileNormal, pooled, wholes
from bv_sharding.optimizers.tiles import ShardBlocks

COLLECTIVES = ("all-gather", "all-reduce", "all-to-all", "collective-permute", "reduce-scatter")


def test_a_pool_draws_the_whole_probes_tiles_in_place_with_no_collective():
  keys = jax.random.split(jax.random.PRNGKey(3), 5)
  cut = lambda shape, scanned=False: ShardBlocks(
      shape, (1,) * len(shape), block_size=4, scanned=scanned, pooled=True
  )
  # 4 x 4 tiles: two (the second half padding), one (its key itself), two layers', four.
  shapes = [((6, 4), False), ((4, 4), False), ((2, 4, 4), True), ((8, 8), False)]
  members = [
      (TileNormal(keys, i + 1, jnp.float32), cut(shape, scanned))
      for i, (shape, scanned) in enumerate(shapes)
  ]
  mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  dealt = lambda x: jax.lax.with_sharding_constraint(
      x, NamedSharding(mesh, P("data", *(None,) * (x.ndim - 1)))
  )
  draw = jax.jit(lambda: pooled(members, 16, dealt))
  hlo = draw.lower().compile().as_text()
  assert not [op for op in COLLECTIVES if f" {op}(" in hlo or f" {op}-start(" in hlo]
  tiles = np.asarray(draw())
  expected = np.concatenate(
      [blocks.split(whole) for whole, (_, blocks) in zip(wholes(members), members)]
  )
  assert tiles.shape == (16, 4, 4)
  np.testing.assert_array_equal(tiles[:9], expected)
  assert not tiles[1, 2:].any()  # Past the (6, 4) param's edge.
  np.testing.assert_array_equal(tiles[9:], np.broadcast_to(expected[-1], (7, 4, 4)))
  one_tile = jax.random.normal(keys[2], (4, 4))
  np.testing.assert_array_equal(tiles[2], one_tile)  # psgd-jax's draw of a (4, 4) param.
  assert len({t.tobytes() for t in tiles[:9]}) == 9  # Every tile its own key.
