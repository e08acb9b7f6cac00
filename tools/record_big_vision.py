"""Records big_vision's own behaviour as data for the tests: placements, schedules, optimizer.

big_vision is not on PyPI and none of its code is copied into this project; this
tool imports it from a checkout and stores

- ``tests/data/big_vision_placements.json`` (``tests/library/test_big_vision_placements.py``):
  for each param tree, strategy and mesh, the ``PartitionSpec`` big_vision's
  ``sharding.infer_sharding`` gives every leaf. The trees are big_vision's own
  models (ViT-B/16, ViT-L/16, So400m/14, PaliGemma with Gemma 2B), shaped with
  ``jax.eval_shape``, and this project's Llama (125m, 7b scanned);
- ``tests/data/big_vision_optax.json`` (``tests/optimizers/test_from_config.py``,
  ``tests/library/test_big_vision_dropin.py``):
  ``utils.create_learning_rate_schedule`` at every step for a set of
  ``config.schedule`` dicts, and the params after each step of
  ``optax.make(config, ...)`` on a small tree for a few optimizer sections.

Run it as::

    git clone https://github.com/google-research/big_vision /tmp/big_vision
    pip install --target /tmp/bv_deps einops      # Gemma's attention uses it
    PYTHONPATH=/tmp/big_vision:/tmp/bv_deps:. python tools/record_big_vision.py

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

DATA = pathlib.Path(__file__).resolve().parents[1] / "tests/data"

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


def stub_missing_imports():
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
  stub_missing_imports()
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


SCHEDULES = {  # name -> (config.schedule dict, total_steps, batch_size, data_size)
    "default_stair": ({}, 100, None, None),
    "cosine_warmup": (dict(decay_type="cosine", warmup_steps=10), 100, None, None),
    "linear_percent_end": (
        dict(decay_type="linear", warmup_percent=0.1, linear_end=0.01),
        100,
        None,
        None,
    ),
    "polynomial_cooldown": (
        dict(decay_type="polynomial", power=2, end=0.1, cooldown_steps=5),
        100,
        None,
        None,
    ),
    "rsqrt": (dict(decay_type="rsqrt", timescale=20, warmup_steps=5, shift=3), 100, None, None),
    "stair_steps": (dict(decay_type="stair", steps=[30, 60], mults=[0.1, 0.01]), 100, None, None),
    "examples_mult": (dict(decay_type="cosine", warmup_examples=640, mult=2.0), 100, 64, None),
    "epochs_batch_scaled": (
        dict(decay_type="cosine", warmup_epochs=1, scale_with_batchsize=True),
        100,
        32,
        320,
    ),
}
OPTIMIZER_SECTIONS = {
    "adam_cosine_wd_clip": dict(
        optax_name="scale_by_adam",
        optax=dict(b2=0.95),
        lr=0.1,
        wd=0.01,
        schedule=dict(decay_type="cosine", warmup_steps=2),
        grad_clip_norm=1.0,
    ),
    "paligemma_freeze_img": dict(
        optax_name="scale_by_adam",
        lr=0.05,
        wd=0.1,
        schedule=[
            ("img/.*", None),
            ("llm/.*", dict(decay_type="linear", warmup_percent=0.2, linear_end=0.1)),
        ],
        lr_mults=[(".*/norm/.*", 0.5)],
        wd_mults=[(".*/kernel$", 1.0), (".*/scale$", 0.5)],
    ),
    "sgd_trace_stair": dict(
        optax_name="trace",
        optax=dict(decay=0.9),
        lr=0.1,
        schedule=[(".*", dict(decay_type="stair", steps=[3], mults=[0.1]))],
    ),
    # big_vision's own optimizers (optax.big_vision.*), bfloat16 momentum included.
    "bv_adafactor": dict(
        optax_name="big_vision.scale_by_adafactor",
        optax=dict(min_dim_size_to_factor=3, clipping_threshold=1.0),
        lr=0.1,
        wd=0.01,
        schedule=dict(decay_type="cosine", warmup_steps=2),
    ),
    "bv_momentum_hp": dict(
        optax_name="big_vision.momentum_hp",
        optax=dict(momentum=0.8, nesterov=True),
        lr=0.1,
        grad_clip_norm=1.0,
    ),
}
OPTIMIZER_STEPS = 6
OPTIMIZER_TOTAL_STEPS = 10


def small_params():
  """The small tree the optimizer sections run on (the tests build the same)."""
  return {
      "img": {"kernel": np.linspace(-1, 1, 12).reshape(4, 3), "bias": np.linspace(0, 1, 3)},
      "llm": {
          "dense": {"kernel": np.linspace(1, -1, 15).reshape(3, 5)},
          "norm": {"scale": np.ones(5)},
      },
  }


def small_grads(params, step):
  """Deterministic gradients at ``step`` (the tests use the same)."""
  return jax.tree.map(lambda p: np.cos(p * (step + 1)) + 0.1 * p, params)


def record_optax() -> dict:
  import ml_collections
  from big_vision import optax as bv_optax
  from big_vision import utils

  schedules = {}
  for name, (sched, total, batch, data) in SCHEDULES.items():
    kw = {k: v for k, v in sched.items() if k != "mult"}  # optax.make passes mult as base
    fn = utils.create_learning_rate_schedule(total, batch, data, base=sched.get("mult", 1.0), **kw)
    schedules[name] = [float(fn(s)) for s in range(total + 1)]
  runs = {}
  for name, section in OPTIMIZER_SECTIONS.items():
    config = ml_collections.ConfigDict(section)
    params = jax.tree.map(lambda x: np.asarray(x, np.float32), small_params())
    tx, _ = bv_optax.make(config, params, sched_kw=dict(total_steps=OPTIMIZER_TOTAL_STEPS))
    state = tx.init(params)
    trajectory = []
    for step in range(OPTIMIZER_STEPS):
      updates, state = tx.update(small_grads(params, step), state, params)
      params = jax.tree.map(lambda p, u: p + u, params, updates)
      named, _ = utils.tree_flatten_with_names(params)
      trajectory.append({n: np.asarray(v).tolist() for n, v in named})
    runs[name] = trajectory
  return dict(schedules=schedules, optimizers=runs)


def main():
  checkout = next(p for p in sys.path if os.path.isfile(os.path.join(p, "big_vision/sharding.py")))
  commit = subprocess.run(
      ["git", "-C", checkout, "rev-parse", "HEAD"], capture_output=True, text=True
  ).stdout.strip()
  commit = commit or os.environ.get("BIG_VISION_COMMIT", "unknown")
  placements = dict(
      big_vision_commit=commit,
      numpy=np.__version__,
      meshes={k: [list(p) for p in v] for k, v in MESHES.items()},
      strategies={k: [list(p) for p in v] for k, v in STRATEGIES.items()},
      **record(),
  )
  optax_data = dict(big_vision_commit=commit, **record_optax())
  for name, data in (("placements", placements), ("optax", optax_data)):
    path = DATA / f"big_vision_{name}.json"
    path.write_text(json.dumps(data, indent=None, separators=(",", ":")) + "\n")
    print("wrote", path)


if __name__ == "__main__":
  main()
