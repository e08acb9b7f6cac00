"""Records big_vision's own param placements as data for ``tests/test_big_vision_placements.py``.

big_vision is not on PyPI and none of its code is copied into this project; this
tool imports it from a checkout and stores, for each param tree, strategy and
mesh, the ``PartitionSpec`` big_vision's ``sharding.infer_sharding`` gives every
leaf (``tests/data/big_vision_placements.json``). The trees are big_vision's own
models (ViT-B/16, ViT-L/16, So400m/14, PaliGemma with Gemma 2B), shaped with
``jax.eval_shape``, and this project's Llama (125m, 7b scanned)::

    git clone https://github.com/google-research/big_vision /tmp/big_vision
    pip install --target /tmp/bv_deps einops      # Gemma's attention uses it
    PYTHONPATH=/tmp/big_vision:/tmp/bv_deps:. python tools/record_big_vision_placements.py

big_vision imports ``tensorflow.io.gfile`` at module level but shaping and
placing use none of it; when TensorFlow is not installed, empty stand-in
modules let the import succeed.
"""

import importlib.machinery
import json
import os
import pathlib
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np

OUTPUT = pathlib.Path(__file__).resolve().parents[1] / "tests/data/big_vision_placements.json"

MESHES = {
    "data8": (("data", 8),),
    "data256": (("data", 256),),
    "data64_model4": (("data", 64), ("model", 4)),
    "data2_model4": (("data", 2), ("model", 4)),
}
STRATEGIES = {
    "fsdp": [(".*", 'fsdp(axis="data")')],
    "fsdp_1mb": [(".*", "fsdp(axis='data', min_size_to_shard_mb=1)")],
    "fsdp_2d": [(".*", 'fsdp(axis=("data", "model"))')],
    "replicate": [(".*", "replicate")],
    "frozen_img": [(".*/img/.*", "replicate"), (".*", 'fsdp(axis="data")')],
    "shard_dim_then_fsdp": [
        (".*/kernel", 'shard_dim("model", -1, ignore_ndim_error=True)|fsdp(axis="data")'),
        (".*", 'fsdp("data", 1)'),
    ],
    # Puts "model" on dims it does not divide (pos embeddings, scanned layer axes).
    "shard_dim_first": [(".*", 'shard_dim("model", 0, ignore_ndim_error=True) | fsdp("data")')],
}
# Which strategies run on which meshes (the 2-D ones need a "model" axis).
RUNS = {
    "data8": ("fsdp", "fsdp_1mb", "replicate", "frozen_img"),
    "data256": ("fsdp", "fsdp_1mb"),
    "data64_model4": ("fsdp", "fsdp_2d", "shard_dim_then_fsdp", "shard_dim_first"),
    "data2_model4": ("fsdp_2d", "shard_dim_then_fsdp", "shard_dim_first"),
}


def _stub_missing_imports():
  for name in ("tensorflow", "tensorflow.io", "tensorflow.io.gfile"):
    try:
      __import__(name)
    except ImportError:
      module = types.ModuleType(name)
      module.__spec__ = importlib.machinery.ModuleSpec(name, None)
      sys.modules[name] = module
  tf = sys.modules["tensorflow"]
  if not hasattr(tf, "errors"):
    tf.errors = types.SimpleNamespace(NotFoundError=FileNotFoundError, OpError=OSError)
    tf.Tensor = tf.Variable = type("NotATensor", (), {})  # einops probes these.
    tf.io = sys.modules["tensorflow.io"]
    tf.io.gfile = sys.modules["tensorflow.io.gfile"]


def _vit(variant, **kw):
  from big_vision.models import vit

  model = vit.Model(variant=variant, **kw)
  image = jax.ShapeDtypeStruct((1, 224, 224, 3), jnp.float32)
  return lambda: model.init(jax.random.key(0), jnp.zeros(image.shape))["params"]


def _paligemma():
  from big_vision.models.proj.paligemma import paligemma

  model = paligemma.Model(
      img=dict(variant="So400m/14", pool_type="none", scan=True),
      llm=dict(variant="gemma_2b", vocab_size=256_000 + 1024 + 128),
  )
  image = jnp.zeros((1, 224, 224, 3))
  text = jnp.zeros((1, 8), jnp.int32)
  return lambda: model.init(jax.random.key(0), image, text, text)["params"]


def _llama(size, scan):
  from trainers.models import llama

  model = llama.build(size, scan_layers=scan)
  return lambda: model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]


TREES = {
    "vit_b16": lambda: _vit("B/16", num_classes=1000),
    "vit_l16": lambda: _vit("L/16", num_classes=1000),
    "so400m14": lambda: _vit("So400m/14", num_classes=0, pool_type="map"),
    "paligemma_3b": _paligemma,
    "llama_125m": lambda: _llama("125m", False),
    "llama_7b_scan": lambda: _llama("7b", True),
}


def _spec_list(spec):
  return [list(a) if isinstance(a, tuple) else a for a in spec]


def record() -> dict:
  _stub_missing_imports()
  import flax.linen as nn
  from big_vision import sharding, utils

  trees = {}
  runs = []
  for tree_name, make in TREES.items():
    params = nn.unbox(jax.eval_shape(make()))
    named, _ = utils.tree_flatten_with_names({"params": params})
    trees[tree_name] = {name: [list(x.shape), str(x.dtype)] for name, x in named}
    for mesh_name, runs_here in RUNS.items():
      names, sizes = zip(*MESHES[mesh_name])
      mesh = jax.sharding.AbstractMesh(sizes, names)
      for strategy_name in runs_here:
        shardings = sharding.infer_sharding({"params": params}, STRATEGIES[strategy_name], mesh)
        flat, _ = utils.tree_flatten_with_names(shardings)
        sharded = {
            name: _spec_list(s.spec) for name, s in flat if any(a is not None for a in s.spec)
        }
        runs.append(dict(tree=tree_name, mesh=mesh_name, strategy=strategy_name, sharded=sharded))
        print(tree_name, mesh_name, strategy_name, len(sharded), "of", len(flat), "sharded")
  return dict(trees=trees, runs=runs)


def main():
  checkout = next(p for p in sys.path if os.path.isfile(os.path.join(p, "big_vision/sharding.py")))
  commit = subprocess.run(
      ["git", "-C", checkout, "rev-parse", "HEAD"], capture_output=True, text=True
  ).stdout.strip()
  data = dict(
      big_vision_commit=commit or os.environ.get("BIG_VISION_COMMIT", "unknown"),
      numpy=np.__version__,
      meshes={k: [list(p) for p in v] for k, v in MESHES.items()},
      strategies={k: [list(p) for p in v] for k, v in STRATEGIES.items()},
      **record(),
  )
  OUTPUT.write_text(json.dumps(data, indent=None, separators=(",", ":")) + "\n")
  print("wrote", OUTPUT)


if __name__ == "__main__":
  main()
