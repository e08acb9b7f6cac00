"""Plan speed: engine time to plan a 7B-shaped unscanned Llama with PSGD Kron state on 256 devices.

The tree (params, Adam-style momentum and one Kron factor per param dim: over a
thousand leaves) is built once with ``jax.eval_shape``; only planning is timed
(best of ``--repeats``): ``bvs.infer_sharding`` (plan, ``NamedSharding`` and spec trees,
as the seed returns) and ``bvs.plan`` alone. ``--seed PATH`` times the seed's ``infer_sharding`` with
its ``fsdp_sharding`` rule on the same tree and mesh, loaded from PATH (the seed
lives outside this repository; its two helpers from big_vision's ``utils`` are
supplied here).

  python -m benchmarks.plan_speed --seed /work/shared/seeds/sharding.py
"""

import contextlib
import importlib.util
import io
import sys
import time
import types

import flax.linen as nn
import jax
import jax.numpy as jnp

import bv_sharding as bvs
from trainers import models, optimizers
from trainers.settings import cli

POD = [("data", 64), ("model", 4)]
STRATEGY = [(".*", 'tensor_parallel(axis="model")|llm_fsdp(axis="data")')]


def tree():
  """``{"params", "opt"}`` shapes of an unscanned 7B Llama with unblocked Kron state."""
  model = models.get_model("llama", size="7b", scan_layers=False)
  params = nn.unbox(
      jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
  )
  opt = jax.eval_shape(optimizers.make_optimizer("kron", 1e-3, block_size=None).init, params)
  return {"params": params, "opt": opt}


def best_time(fn, repeats: int) -> float:
  """The fastest of ``repeats`` calls of ``fn``, in seconds."""
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return min(times)


def load_seed(path: str):
  """The seed module from ``path``, with a ``utils`` stand-in for its two big_vision helpers."""
  utils = types.ModuleType("utils")
  utils.tree_flatten_with_names = lambda t: (
      bvs.ops.flatten_with_names(t)[0],
      jax.tree.structure(t),
  )
  utils.write_note = lambda note: None
  sys.modules.setdefault("utils", utils)
  spec = importlib.util.spec_from_file_location("seed_sharding", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@cli.command
def main(argv=None):
  parser = cli.Parser("python -m benchmarks.plan_speed", __doc__)
  parser.add_argument("--seed", help="path of the seed's sharding.py, to time it too")
  parser.add_argument("--repeats", type=int, default=5)
  args = parser.parse_args(argv)
  state = tree()
  leaves = len(jax.tree.leaves(state))
  mesh = bvs.make_abstract_mesh(POD, 256)
  ours = best_time(lambda: bvs.infer_sharding(state, STRATEGY, mesh), args.repeats)
  plan_only = best_time(lambda: bvs.plan(state, STRATEGY, mesh), args.repeats)
  print("| planner | leaves | mesh | time (ms) | vs bv_sharding |")
  print("|---|---|---|---|---|")
  print(
      f"| bv_sharding `infer_sharding` (plan + shardings) | {leaves} | {dict(mesh.shape)} | "
      f"{1e3 * ours:.1f} | 1.00 |"
  )
  print(
      f"| bv_sharding `plan` alone | {leaves} | {dict(mesh.shape)} | {1e3 * plan_only:.1f} | "
      f"{plan_only / ours:.2f} |"
  )
  if args.seed:
    seed = load_seed(args.seed)
    op = seed.fsdp_sharding("data")
    with contextlib.redirect_stdout(io.StringIO()):  # The seed prints a line per leaf.
      theirs = best_time(lambda: seed.infer_sharding(state, mesh, op), args.repeats)
    print(
        f"| seed `infer_sharding(fsdp_sharding)` | {leaves} | {dict(mesh.shape)} | "
        f"{1e3 * theirs:.1f} | {theirs / ours:.2f} |"
    )


if __name__ == "__main__":
  main()
