"""Abstract trees for tests and benchmarks: shapes and dtypes only, nothing allocated.

Example:
  >>> llama_params(d=8, vocab=16, ff=32)["block"]["mlp"]["down_kernel"]
  ShapeDtypeStruct(shape=(32, 8), dtype=float32)
"""

import jax
import jax.numpy as jnp


def sds(*shape, dtype=jnp.float32) -> jax.ShapeDtypeStruct:
  """An abstract array: ``sds(4, 8)`` is a float32 ``(4, 8)`` shape, nothing allocated.

  Example:
    >>> sds(4, 8)
    ShapeDtypeStruct(shape=(4, 8), dtype=float32)
  """
  return jax.ShapeDtypeStruct(shape, dtype)


def llama_params(d=64, vocab=256, ff=128, layers=None, dtype=jnp.float32):
  """Llama-named abstract params; ``layers`` adds a leading scanned-layer axis to the block."""
  layer_dims = () if layers is None else (layers,)
  s = lambda *shape: sds(*layer_dims, *shape, dtype=dtype)
  return {
      "embed": {"embedding": sds(vocab, d, dtype=dtype)},
      "block": {
          "attn": {
              "q_kernel": s(d, d),
              "k_kernel": s(d, d),
              "v_kernel": s(d, d),
              "out_kernel": s(d, d),
          },
          "mlp": {"gate_kernel": s(d, ff), "up_kernel": s(d, ff), "down_kernel": s(ff, d)},
          "attn_norm": {"scale": s(d)},
          "mlp_norm": {"scale": s(d)},
      },
      "final_norm": {"scale": sds(d, dtype=dtype)},
      "head": {"kernel": sds(d, vocab, dtype=dtype)},
  }
