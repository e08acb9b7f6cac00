"""Memory benchmark: params + optimizer-state bytes per device / (total / N).

Llama-shaped 125M and 7B trees (abstract: nothing is allocated), N = 8 and 256
(``AbstractMesh``), every optimizer of ``benchmarks/zoo.py``, the default plan next to
the baselines of ``benchmarks/placements.py``. Goal: ratio <= 1.02.

  python -m benchmarks.memory
"""

import flax.linen as nn
import jax
import jax.numpy as jnp

import bv_sharding as bvs
from benchmarks import placements, zoo
from bv_sharding.specs import MiB
from trainers.models import get_model

GiB = 1024 * MiB


def llama_shape(size: str):
  model = get_model("llama", size=size)
  tokens = jnp.zeros((1, 8), jnp.int32)
  return nn.unbox(jax.eval_shape(model.init, jax.random.key(0), tokens)["params"])


def rows(size: str, devices: int):
  params = llama_shape(size)
  mesh = bvs.make_abstract_mesh([("data", -1)], devices)
  for name, tx in zoo.optimizers(params, block_size=1024).items():
    opt = jax.eval_shape(tx.init, params)
    for placement, p in placements.placements(params, opt, mesh, name in zoo.SECOND_ORDER).items():
      ratio = p.plan.bytes_per_device / (p.plan.total_bytes / devices)
      yield (
          size,
          devices,
          name,
          placement,
          p.plan.total_bytes / GiB,
          p.plan.bytes_per_device / MiB,
          ratio,
      )


def main():
  print("| model | N | optimizer | placement | total GiB | MiB/device | ratio to ideal |")
  print("|---|---|---|---|---|---|---|")
  for size in ("125m", "7b"):
    for devices in (8, 256):
      for size_, n, name, placement, total, per_device, ratio in rows(size, devices):
        mark = "" if placement != "default" or ratio <= 1.02 else " (over 1.02)"
        print(
            f"| {size_} | {n} | {name} | {placement} | {total:.2f} | {per_device:.1f} | "
            f"{ratio:.3f}{mark} |",
            flush=True,
        )


if __name__ == "__main__":
  main()
