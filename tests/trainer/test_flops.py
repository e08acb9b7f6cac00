"""The matmul FLOPs counter: a scan's body counts once per trip, where XLA counts it once."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import bv_sharding as bvs
from trainers.figures import flops

X = jax.ShapeDtypeStruct((64, 32), jnp.float32)
W = jnp.ones((32, 32))
MATMUL = 2 * 64 * 32 * 32  # One (64, 32) @ (32, 32).


def layer(x, _=None):
  return jnp.tanh(x @ W), None


def test_a_scan_counts_its_body_once_per_trip_where_xla_counts_it_once():
  def scanned(n):
    return jax.jit(lambda x: jax.lax.scan(layer, x, length=n)[0])

  traced = [flops.traced_flops(scanned(n), X) for n in (1, 4, 16)]
  assert traced == [MATMUL, 4 * MATMUL, 16 * MATMUL]
  xla = [scanned(n).lower(X).compile().cost_analysis()["flops"] for n in (1, 16)]
  assert xla[1] < 1.01 * xla[0]  # What the counter is for.


def test_unrolled_scanned_and_rematerialised_layers_count_the_same():
  unrolled = lambda x: layer(layer(layer(x)[0])[0])[0]
  scanned = lambda x: jax.lax.scan(layer, x, length=3)[0]
  remat = lambda x: jax.lax.scan(jax.checkpoint(layer), x, length=3)[0]
  assert {flops.traced_flops(f, X) for f in (unrolled, scanned, remat)} == {3 * MATMUL}


def test_dot_general_with_batch_dims_counts_every_multiply_add():
  q = jax.ShapeDtypeStruct((2, 4, 16, 8), jnp.float32)  # batch, heads, seq, head_dim
  scores = lambda q, k: jnp.einsum("bhqd,bhkd->bhqk", q, k)
  assert flops.traced_flops(scores, q, q) == 2 * 2 * 4 * 16 * 16 * 8


def test_conv_counts_each_output_over_its_input_features_and_window():
  image = jax.ShapeDtypeStruct((2, 8, 8, 3), jnp.float32)
  kernel = jax.ShapeDtypeStruct((3, 3, 3, 16), jnp.float32)
  conv = lambda x, k: jax.lax.conv_general_dilated(
      x, k, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
  )
  assert flops.traced_flops(conv, image, kernel) == 2 * (2 * 8 * 8 * 16) * (3 * 3 * 3)


def test_cond_counts_its_costliest_branch_and_while_its_body_once():
  cond = lambda x: jax.lax.cond(x.sum() > 0, lambda x: x @ W @ W, lambda x: x @ W, x)
  loop = lambda x: jax.lax.while_loop(lambda c: c[1] < 5, lambda c: (c[0] @ W, c[1] + 1), (x, 0))
  assert flops.traced_flops(cond, X) == 2 * MATMUL
  assert flops.traced_flops(loop, X) == MATMUL


def test_shard_map_counts_the_shard_body_on_every_shard():
  mesh = bvs.make_mesh([("data", -1)])
  rows = jax.ShapeDtypeStruct(X.shape, X.dtype, sharding=NamedSharding(mesh, P("data")))
  per_shard = jax.shard_map(lambda x: x @ W, mesh=mesh, in_specs=P("data"), out_specs=P("data"))
  assert jax.device_count() == 8
  assert flops.traced_flops(per_shard, rows) == MATMUL


def custom_jvp(f):
  g = jax.custom_jvp(f)
  g.defjvp(lambda primals, tangents: (f(*primals), tangents[0]))
  return g


def custom_vjp(f):
  g = jax.custom_vjp(f)
  g.defvjp(lambda x: (f(x), None), lambda _, cotangent: (cotangent,))
  return g


@pytest.mark.parametrize("wrap", [jax.jit, jax.checkpoint, custom_jvp, custom_vjp])
def test_sub_programs_are_counted(wrap):
  inner = wrap(lambda x: x @ W)
  assert flops.traced_flops(lambda x: inner(x) @ W, X) == 2 * MATMUL
