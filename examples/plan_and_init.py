"""Plans a Flax model and its AdamW state on 8 simulated CPU devices, inits them born sharded,
and prints the plan table.

  python examples/plan_and_init.py
"""

import jax

jax.config.update("jax_num_cpu_devices", 8)

import flax.linen as nn  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import bv_sharding as bvs  # noqa: E402


class Decoder(nn.Module):
  """Two Llama-named MLP blocks over an embedding."""

  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(4096, 512, name="embed")(tokens)
    for i in range(2):
      h = nn.RMSNorm(name=f"block{i}_norm")(x)
      up = self.param(f"block{i}_up_kernel", nn.initializers.lecun_normal(), (512, 2048))
      down = self.param(f"block{i}_down_kernel", nn.initializers.lecun_normal(), (2048, 512))
      x = x + nn.gelu(h @ up) @ down
    return x @ self.variables["params"]["embed"]["embedding"].T


def main():
  mesh = bvs.make_mesh([("data", -1), ("model", 2)])
  strategy = [
      (".*embedding", 'shard_dim(axis="model", dim=-1)|fsdp(axis="data")'),
      (".*", 'fsdp(axis="data", min_size_to_shard_mb=1)'),
  ]
  model, tx = Decoder(), optax.adamw(1e-3)
  tokens = jnp.zeros((8, 16), jnp.int32)
  init = lambda rng: model.init(rng, tokens)["params"]
  params_shape = jax.eval_shape(init, jax.random.key(0))
  opt_shape = jax.eval_shape(tx.init, params_shape)
  plan = bvs.plan({"params": params_shape, "opt": opt_shape}, strategy, mesh)
  print(plan.report())
  params = jax.jit(init, out_shardings=plan.shardings["params"])(jax.random.key(0))
  opt = jax.jit(tx.init, out_shardings=plan.shardings["opt"])(params)
  assert plan.mismatches({"params": params, "opt": opt}) == []
  print(f"born sharded on {mesh.devices.size} devices: every array matches the plan")


if __name__ == "__main__":
  main()
