"""``bv_sharding.big_vision`` in place of big_vision's ``sharding`` and ``optax`` imports.

The flow is big_vision's ``train.py`` (shapes with ``jax.eval_shape``, ``bv_optax.make``,
``bv_sharding.infer_sharding`` under ``nn.logical_axis_rules``, both inits jitted into the
inferred shardings, an update step counting with ``get_count``) on a small ViT-like model
with 3-D and 4-D params; the placements and the optimizer trajectories are big_vision's own,
recorded as data by ``tools/record_big_vision.py`` (none of its code is here).
"""

import collections
import functools
import importlib.util
import json
import pathlib
import subprocess
import sys
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import bv_sharding as bvs
import bv_sharding.big_vision.optax as bv_optax
import bv_sharding.big_vision.sharding as bv_sharding
from bv_sharding.big_vision.layout import layout_of, mesh_of
from bv_sharding.optimizers import SOAP_LR_SCALE, Stacks
from bv_sharding.optimizers.placement import stored_spec
from tests import helpers

ROOT = pathlib.Path(__file__).resolve().parents[2]
RULES = [("act_batch", "data"), ("mlp", "model"), ("embed", None)]
STRATEGY = [(".*", 'logical_partitioning|fsdp(axis="data", min_size_to_shard_mb=0)')]


@functools.cache
def record():
  spec = importlib.util.spec_from_file_location("record", ROOT / "tools/record_big_vision.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@functools.cache
def recorded(name: str) -> dict:
  return json.loads((ROOT / f"tests/data/big_vision_{name}.json").read_text())


class TinyViT(nn.Module):
  """Patch embedding (4-D kernel), position embedding and attention kernels (3-D), an MLP
  whose kernels carry logical names, a head."""

  @nn.compact
  def __call__(self, images):
    x = nn.Conv(32, (4, 4), strides=(4, 4), name="embedding")(images)
    x = x.reshape(x.shape[0], -1, 32)
    pos = self.param("pos_embedding", nn.initializers.normal(0.02), (1, x.shape[1], 32))
    x = x + pos
    x = x + nn.MultiHeadDotProductAttention(num_heads=4, name="attention")(x, x)
    dense = lambda n, names, name: nn.Dense(
        n,
        kernel_init=nn.with_logical_partitioning(nn.initializers.lecun_normal(), names),
        name=name,
    )
    x = x + dense(32, ("mlp", "embed"), "mlp_out")(
        nn.gelu(dense(64, ("embed", "mlp"), "mlp_in")(x))
    )
    return nn.Dense(10, name="head")(x.mean(axis=1))


def _batch(step):
  rng = np.random.default_rng(step)
  images = rng.normal(size=(16, 16, 16, 3)).astype(np.float32)
  return images, (images[:, :4, :4, 0].sum(axis=(1, 2)) > 0).astype(np.int32)


class Flow(NamedTuple):
  """What big_vision's flow built: the chain, its shapes, the planned shardings, the train
  state after the steps, and the losses and counts each step measured."""

  tx: optax.GradientTransformation
  params_shape: dict
  opt_shape: Any
  shardings: dict
  state: dict
  losses: list
  counts: list


def train_state_flow(config, model, example, batch, loss_fn, mesh, steps: int) -> Flow:
  """big_vision's ``train.py`` from its shapes to ``steps`` updates of one batch: eval_shape of
  init, ``make``, ``infer_sharding`` under the rules' context, both inits jitted into the
  inferred shardings, the update step counting with ``get_count``. Every transfer is explicit
  (``device_put``, ``device_get``), as ``train.py``'s global ``jax_transfer_guard="disallow"``
  asks; ``example`` may be a shape (``jax.ShapeDtypeStruct``)."""

  def init(rng):
    return model.init(rng, jnp.zeros(example.shape, example.dtype))["params"]

  repl = NamedSharding(mesh, P())
  rng = jax.device_put(jax.random.key(jax.device_put(0)), repl)
  params_shape = jax.eval_shape(init, rng)
  sched_kw = dict(total_steps=steps, batch_size=example.shape[0])
  tx, sched_fns = bv_optax.make(config, nn.unbox(params_shape), sched_kw=sched_kw)
  first_lr = jax.device_get(jax.jit(sched_fns[0])(jax.device_put(1)))
  assert float(first_lr) == pytest.approx(1.0)  # warmup_steps=1, or a constant schedule
  opt_shape = jax.eval_shape(tx.init, params_shape)
  with nn.logical_axis_rules(config["sharding_rules"]):
    shardings = bv_sharding.infer_sharding(
        {"params": params_shape, "opt": opt_shape}, strategy=config["sharding_strategy"], mesh=mesh
    )
  params = jax.jit(init, out_shardings=shardings["params"])(rng)
  opt = jax.jit(tx.init, out_shardings=shardings["opt"])(params)
  state = nn.unbox({"params": params, "opt": opt})

  @functools.partial(jax.jit, donate_argnums=(0,), out_shardings=(shardings, repl))
  def update_fn(train_state, batch):
    count = bv_optax.get_count(train_state["opt"], jittable=True)
    loss, grads = jax.value_and_grad(loss_fn)(train_state["params"], *batch)
    updates, opt = tx.update(grads, train_state["opt"], train_state["params"])
    params = optax.apply_updates(train_state["params"], updates)
    return {"params": params, "opt": opt}, {"loss": loss, "count": count}

  batch = jax.device_put(batch, repl)
  losses, counts = [], []
  for _ in range(steps):
    state, measured = update_fn(state, batch)
    measured = jax.device_get(measured)
    counts.append(int(measured["count"]))
    losses.append(float(measured["loss"]))
  assert bv_optax.get_count(jax.device_get(state["opt"])) == steps
  return Flow(tx, nn.unbox(params_shape), nn.unbox(opt_shape), shardings, state, losses, counts)


def _classifier_loss(model):
  def loss_fn(params, images, labels):
    logits = model.apply({"params": params}, images)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

  return loss_fn


def test_big_visions_train_state_flow_with_logical_rules_on_a_2d_mesh():
  """Adam on a ViT whose MLP kernels carry logical names, on ``data`` 4 x ``model`` 2 (the
  1-D mesh is the flow test below)."""
  model, steps = TinyViT(), 6
  config = dict(
      optax_name="scale_by_adam",
      optax=dict(b2=0.95),
      lr=3e-3,
      wd=1e-4,
      grad_clip_norm=1.0,
      schedule=dict(decay_type="cosine", warmup_steps=1),
      mesh=[("data", 4), ("model", 2)],
      sharding_strategy=STRATEGY,
      sharding_rules=RULES,
  )
  example = jnp.zeros((16, 16, 16, 3))
  mesh = mesh_of(config)
  flow = train_state_flow(config, model, example, _batch(0), _classifier_loss(model), mesh, steps)

  specs = jax.tree.map(lambda x: x.sharding.spec, flow.state["params"])
  # (32, 64): "mlp" -> "model" by the rules, then fsdp takes the largest free dim.
  assert specs["mlp_in"]["kernel"] == P("data", "model")
  assert specs["embedding"]["kernel"] == P(None, None, None, "data")  # 4-D: (4, 4, 3, 32)
  assert specs["attention"]["query"]["kernel"][0] == "data"  # 3-D: (32, 4, 8)
  mu = bv_optax.find_states(flow.state["opt"], optax.ScaleByAdamState)[0].mu
  assert jax.tree.map(lambda x: x.sharding.spec, mu) == specs  # state follows its params
  assert flow.counts == list(range(steps))
  assert flow.losses[-1] < 0.8 * flow.losses[0], flow.losses


class SmallViT(nn.Module):
  """A ViT block's kernels at widths the 8 devices divide: a 4-D conv patch embedding
  ``(4, 4, 3, 64)``, 3-D attention kernels ``(64, 8, 8)`` and ``(8, 8, 64)``, a head (no
  biases: the Llama's norm scales are the 1-D params; fewer leaves compile faster)."""

  @nn.compact
  def __call__(self, images):
    x = nn.Conv(64, (4, 4), strides=(4, 4), use_bias=False, name="embedding")(images)
    x = x.reshape(x.shape[0], -1, 64)
    x = x + nn.MultiHeadDotProductAttention(num_heads=8, use_bias=False, name="attention")(x, x)
    return nn.Dense(16, use_bias=False, name="head")(x.mean(axis=1))


class TinyLlama(nn.Module):
  """Llama's params in small: embedding (tied head), RMSNorm scales, fused q/k/v and
  gate/up kernels, causal attention, SwiGLU."""

  vocab: int = 64
  width: int = 64
  heads: int = 8

  @nn.compact
  def __call__(self, tokens):
    embed = nn.Embed(self.vocab, self.width, name="embed")
    x = embed(tokens)
    batch, length, _ = x.shape
    h = nn.RMSNorm(name="attention_norm")(x)
    q, k, v = jnp.split(nn.Dense(3 * self.width, use_bias=False, name="qkv")(h), 3, axis=-1)
    q, k, v = (t.reshape(batch, length, self.heads, -1) for t in (q, k, v))
    mask = nn.make_causal_mask(tokens)
    attended = nn.dot_product_attention(q, k, v, mask=mask).reshape(batch, length, self.width)
    x = x + nn.Dense(self.width, use_bias=False, name="out")(attended)
    h = nn.RMSNorm(name="mlp_norm")(x)
    gate, up = jnp.split(nn.Dense(4 * self.width, use_bias=False, name="gate_up")(h), 2, axis=-1)
    x = x + nn.Dense(self.width, use_bias=False, name="down")(nn.silu(gate) * up)
    return embed.attend(nn.RMSNorm(name="final_norm")(x))


def _vit_case():
  model = SmallViT()
  images = np.random.default_rng(0).normal(size=(16, 16, 16, 3)).astype(np.float32)
  labels = (images[:, :4, :4, 0].sum(axis=(1, 2)) > 0).astype(np.int32)
  example = jax.ShapeDtypeStruct(images.shape, jnp.float32)
  return model, example, (images, labels), _classifier_loss(model)


def _llama_case():
  model = TinyLlama()
  tokens = np.random.default_rng(0).integers(0, model.vocab, size=(16, 17)).astype(np.int32)

  def loss_fn(params, inputs, targets):
    logits = model.apply({"params": params}, inputs)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

  example = jax.ShapeDtypeStruct((16, 16), jnp.int32)
  return model, example, (tokens[:, :-1], tokens[:, 1:]), loss_fn


# (config.optax_name, config.optax, config.lr): big_vision's convention, the transformation
# without lr and wd; the library's get the params' layout from config.mesh and the strategy.
OPTIMIZERS = {
    "adam": ("scale_by_adam", {}, 1e-2),
    "kron": (
        "bv_sharding.scale_by_kron",
        dict(block_size=32, preconditioner_update_probability=1.0),
        1e-2,  # Adam's: its first updates are Adam-sized (preconditioner_init_scale=None).
    ),
    "shampoo": ("bv_sharding.scale_by_shampoo", dict(block_size=32, graft_type="adam"), 1e-2),
    "muon": ("bv_sharding.scale_by_muon", {}, 3e-3),
}


def _stack_placements(opt_shape, params_shape, planned, mesh) -> list[tuple]:
  """``(path, planned spec, stored spec)`` of every block stack of the state: where the plan
  put it, and where its blocks under the plan's param specs store it."""
  key = lambda k: str(getattr(k, "key", getattr(k, "idx", k)))
  params = {
      tuple(key(k) for k in path): x
      for path, x in jax.tree_util.tree_flatten_with_path(params_shape)[0]
  }
  param_specs = {
      tuple(key(k) for k in path): s.spec
      for path, s in jax.tree_util.tree_flatten_with_path(planned["params"])[0]
  }
  is_stacks = lambda x: isinstance(x, Stacks)
  nodes = jax.tree_util.tree_flatten_with_path(opt_shape, is_leaf=is_stacks)[0]
  specs = jax.tree.structure(opt_shape).flatten_up_to(planned["opt"])
  found, at = [], 0
  for path, node in nodes:
    if not is_stacks(node):
      at += 1
      continue
    names = tuple(key(k) for k in path)
    param = next(p for p in params if any(names[i : i + len(p)] == p for i in range(len(names))))
    blocks = node.tiling.blocks(params[param].shape, param_specs[param], mesh)
    for x in node:
      found.append((names, specs[at].spec, stored_spec(blocks, x.shape, dict(mesh.shape))))
      at += 1
  return found


def _bytes_per_device(tree) -> tuple[int, float]:
  """The most bytes of ``tree``'s arrays one device holds, and the ideal (total / devices)."""
  held = collections.Counter()
  for x in jax.tree.leaves(tree):
    for shard in x.addressable_shards:
      held[shard.device] += shard.data.nbytes
  return max(held.values()), sum(x.nbytes for x in jax.tree.leaves(tree)) / jax.device_count()


def _fsdp_config(name: str, kwargs: dict, lr: float) -> dict:
  """The flow tests' config of ``config.optax_name`` ``name``: fsdp over all devices."""
  return dict(
      optax_name=name,
      optax=kwargs,
      lr=lr,
      wd=1e-4,
      grad_clip_norm=1.0,
      schedule=dict(decay_type="cosine", warmup_steps=1),
      mesh=[("data", -1)],
      sharding_strategy=[(".*", 'fsdp(axis="data", min_size_to_shard_mb=0)')],
      sharding_rules=[("act_batch", "data")],
  )


@pytest.mark.parametrize("model_case", [_vit_case, _llama_case], ids=["vit", "llama"])
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_big_visions_flow_places_and_trains_each_optimizer_name(optimizer, model_case):
  """Adam and the library's three names in big_vision's flow on a ViT (3-D and 4-D params) and
  a Llama: the state sharded as planned and at most 1.05x the ideal per device, loss falls."""
  model, example, batch, loss_fn = model_case()
  config = _fsdp_config(*OPTIMIZERS[optimizer])
  mesh = mesh_of(config)
  steps = 5
  flow = train_state_flow(config, model, example, batch, loss_fn, mesh, steps)

  assert flow.counts == list(range(steps))
  assert flow.losses[-1] < 0.9 * flow.losses[0], flow.losses
  planned = flow.shardings["opt"]
  assert jax.tree.map(lambda x: x.sharding, flow.state["opt"]) == planned
  held, ideal = _bytes_per_device(flow.state["opt"])
  assert held <= 1.05 * ideal, (held, ideal)
  layout = layout_of(config, flow.params_shape)  # what make gave the optimizer
  assert layout.specs == jax.tree.map(lambda s: s.spec, flow.shardings["params"])
  # Every block stack planned (by infer_sharding, from the state's tree alone) where its
  # blocks are stored.
  placements = _stack_placements(flow.opt_shape, flow.params_shape, flow.shardings, mesh)
  assert bool(placements) == (optimizer in ("kron", "shampoo"))
  assert [p for p in placements if p[1] != p[2]] == []


class EncoderBlock(nn.Module):
  """One layer of :class:`ScannedViT`: attention (3-D kernels), an MLP kernel, a norm scale."""

  @nn.compact
  def __call__(self, x, _):
    x = x + nn.MultiHeadDotProductAttention(num_heads=8, use_bias=False, name="attention")(x, x)
    x = x + nn.Dense(64, use_bias=False, name="mlp")(nn.LayerNorm(use_bias=False, name="norm")(x))
    return x, None


class ScannedViT(nn.Module):
  """big_vision's ViT with ``scan=True`` in small: the encoder's layers stacked by ``nn.scan``
  under ``encoderblock`` (dim 0 the depth), no logical names, as big_vision's models."""

  depth: int = 2

  @nn.compact
  def __call__(self, images):
    x = nn.Conv(64, (4, 4), strides=(4, 4), use_bias=False, name="embedding")(images)
    x = x.reshape(x.shape[0], -1, 64)
    scan = nn.scan(
        EncoderBlock, variable_axes={"params": 0}, split_rngs={"params": True}, length=self.depth
    )
    x, _ = scan(name="encoderblock")(x, None)
    return nn.Dense(16, use_bias=False, name="head")(x.mean(axis=1))


# Every tile's state in its param's block stacks, where the test below reads it: Kron's and
# SOAP's pools not kept where they run (resident_padding 0).
SECOND_ORDER = {
    "kron": (OPTIMIZERS["kron"][0], {**OPTIMIZERS["kron"][1], "resident_padding": 0.0}, 1e-2),
    "shampoo": OPTIMIZERS["shampoo"],
    "soap": ("bv_sharding.scale_by_soap", dict(block_size=32, resident_padding=0.0), 3e-3),
}


def _stack_tilings(opt_shape) -> dict:
  """Per param name under the state's block stacks, the tiling that cut it and its stacks'
  shapes."""
  found = {}
  is_stacks = lambda x: isinstance(x, Stacks)
  for path, node in jax.tree_util.tree_flatten_with_path(opt_shape, is_leaf=is_stacks)[0]:
    if is_stacks(node):
      name = "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
      found[name] = (node.tiling, [x.shape for x in node])
  return found


@pytest.mark.parametrize("optimizer", sorted(SECOND_ORDER))
def test_config_scanned_layers_precondition_each_stacked_layer_as_its_own_matrix(optimizer):
  """``config.scanned_layers`` names the stacks of a scanned ViT: Kron, Shampoo and SOAP cut
  each layer of them on its own (no factor spans the layers), and only of them; without the
  key the depth is one more tensor dim to them. Kron's flow trains and is placed as planned."""
  name, kwargs, lr = SECOND_ORDER[optimizer]
  model = ScannedViT()
  config = dict(
      optax_name=name,
      optax=kwargs,
      lr=lr,
      schedule=dict(decay_type="cosine", warmup_steps=1),
      mesh=[("data", -1)],
      sharding_strategy=[(".*", 'fsdp(axis="data", min_size_to_shard_mb=0)')],
      sharding_rules=[("act_batch", "data")],
  )
  example = jnp.zeros((16, 16, 16, 3))
  params = nn.unbox(jax.eval_shape(lambda: model.init(jax.random.key(0), example)["params"]))
  shapes = lambda config: _stack_tilings(
      jax.eval_shape(bv_optax.make(config, params, sched_kw=dict(total_steps=4))[0].init, params)
  )
  scanned = shapes({**config, "scanned_layers": "encoderblock/.*"})
  plain = shapes(config)
  stacked = {k: v for k, v in scanned.items() if "encoderblock" in k}
  assert stacked and scanned.keys() <= plain.keys()  # Kron: a layer's norm scale is a vector
  for key, (tiling, _) in scanned.items():
    assert tiling.scanned == (key in stacked), key
    assert not plain[key][0].scanned
  for key, (_, stacks) in stacked.items():
    # Each factor stacked over the 2 layers, none 2 x 2 (the depth's own factor, unscanned).
    assert all(shape[0] == 2 for shape in stacks), (key, stacks)
    assert plain[key][1] != stacks, key
    assert not any(shape[-2:] == (2, 2) for shape in stacks), (key, stacks)
  if optimizer == "kron":
    config["scanned_layers"] = ["encoderblock/.*"]
    batch = _batch(0)
    flow = train_state_flow(
        config, model, example, batch, _classifier_loss(model), mesh_of(config), steps=4
    )
    assert flow.losses[-1] < 0.9 * flow.losses[0], flow.losses
    assert jax.tree.map(lambda x: x.sharding, flow.state["opt"]) == flow.shardings["opt"]
    placements = _stack_placements(
        flow.opt_shape, flow.params_shape, flow.shardings, mesh_of(config)
    )
    assert placements and [p for p in placements if p[1] != p[2]] == []


def _params(tree: dict) -> dict:
  root = {}
  for name, (shape, dtype) in tree.items():
    *path, last = name.split("/")
    node = root
    for key in path:
      node = node.setdefault(key, {})
    node[last] = jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype))
  return root


def _entries(spec) -> list:
  return [tuple(e) if isinstance(e, list) else e for e in spec]


@pytest.mark.filterwarnings("ignore::bv_sharding.ShardingWarning")  # ".*/img/.*" on a ViT
@pytest.mark.parametrize("tree_name", ["vit_b16", "paligemma_3b"])
def test_the_shardings_tree_is_big_visions_recorded_placements(tree_name):
  data = recorded("placements")
  tree = _params(data["trees"][tree_name])
  compared = 0
  runs = [r for r in data["runs"] if r["tree"] == tree_name and "shard_dim" not in r["strategy"]]
  for run in runs:
    pairs = [tuple(p) for p in data["meshes"][run["mesh"]]]
    mesh = bvs.make_abstract_mesh(pairs, int(np.prod([s for _, s in pairs])))
    strategy = [tuple(p) for p in data["strategies"][run["strategy"]]]
    flat, _ = bvs.ops.flatten_with_names(bv_sharding.infer_sharding(tree, strategy, mesh))
    for name, sharding in flat:
      assert isinstance(sharding, NamedSharding) and sharding.mesh == mesh
      theirs = _entries(run["sharded"].get(name, ()))
      mine = list(sharding.spec)
      mine += [None] * (len(theirs) - len(mine))
      theirs += [None] * (len(mine) - len(theirs))
      assert mine == theirs, (run["mesh"], run["strategy"], name)
      compared += 1
  assert compared == len(runs) * len(data["trees"][tree_name]) > 0


def _leaf(tree, name):
  for key in name.split("/"):
    tree = tree[key]
  return tree


@pytest.mark.parametrize("name", sorted(record().OPTIMIZER_SECTIONS))
def test_optimizer_sections_update_params_as_big_visions_make(name):
  """Clipping, decoupled wd on wd_mults' leaves, lr_mults, per-regex schedules, frozen
  leaves, big_vision's own Adafactor and bfloat16 momentum: params after each step equal
  big_vision's recorded ones."""
  section = record().OPTIMIZER_SECTIONS[name]
  params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), record().small_params())
  tx, sched_fns = bv_optax.make(
      section, params, sched_kw=dict(total_steps=record().OPTIMIZER_TOTAL_STEPS)
  )
  assert len(sched_fns) == sum(s is not None for _, s in bv_optax.schedule_entries(section))
  # bfloat16 state (big_vision's own optimizers) eagerly, as recorded: under jit XLA may drop
  # the rounding to bfloat16 between ops.
  bfloat16 = section["optax_name"].startswith("big_vision.")
  state, update = tx.init(params), tx.update if bfloat16 else jax.jit(tx.update)
  for step, expected in enumerate(recorded("optax")["optimizers"][name]):
    grads = record().small_grads(params, step)
    if name == "paligemma_freeze_img":
      frozen = bv_optax.replace_frozen(section["schedule"], grads, 0.0)
      assert float(jnp.abs(frozen["img"]["kernel"]).sum()) == 0.0
      assert float(jnp.abs(frozen["llm"]["dense"]["kernel"]).sum()) > 0.0
    updates, state = update(grads, state, params)
    params = optax.apply_updates(params, updates)
    for leaf_name, value in expected.items():
      np.testing.assert_allclose(
          _leaf(params, leaf_name), value, rtol=2e-5, atol=2e-6, err_msg=f"{name} {leaf_name}"
      )
  assert bv_optax.get_count(state) == len(recorded("optax")["optimizers"][name])


def test_big_visions_own_sgd_keeps_no_state_and_momentum_hp_keeps_bfloat16():
  """(Their updates are the recorded sections above.)"""
  params = {"w": jnp.ones((4, 4))}
  states = {}
  for name in ("big_vision.sgd", "big_vision.momentum_hp"):
    config = dict(optax_name=name, lr=1.0)
    tx, _ = bv_optax.make(config, params, sched_kw=dict(total_steps=1))
    states[name] = bv_optax.find_states(tx.init(params), optax.TraceState)
  assert states["big_vision.sgd"] == []
  (momentum,) = states["big_vision.momentum_hp"]
  assert momentum.trace["w"].dtype == jnp.bfloat16


@pytest.mark.parametrize(
    "values, fragments",
    [
        (
            dict(optax_name="bv_sharding.scale_by_kronn"),
            ["library's", "did you mean 'bv_sharding.scale_by_kron'"],
        ),
        (
            dict(optax_name="bv_sharding.scale_by_kron", optax=dict(blocksize=8)),
            ["config.optax={'blocksize': 8}", "Signature: bv_sharding.scale_by_kron("],
        ),
        (
            dict(optax_name="bv_sharding.scale_by_shampoo", optax=dict(block_size=0)),
            ["config.optax={'block_size': 0}", "block_size and update_preconditioners_freq"],
        ),
        (dict(optax_name="scale_by_adamm"), ["neither", "did you mean 'scale_by_adam'"]),
        (dict(optax=dict(beta2=0.9)), ["Signature: scale_by_adam("]),
        (dict(schedule=[("img/.*", {})]), ["'txt/w' matches no regex of config.schedule"]),
        (dict(optim=dict(name="adam")), ["config.optim was retired", "config.optax"]),
        (dict(weight_decay=0.1), ["config.weight_decay was retired", "config.wd"]),
        (dict(lr_mults=[(".*", 0.0)]), ["must be > 0", "(regex, None)"]),
        (dict(wd=0.1, wd_mults=[("/.*", 1.0)]), ["config.wd_mults regex '/.*'", "write '.*'"]),
        (dict(schedule=dict(decay_typ="cosine")), ["did you mean 'decay_type'"]),
        (
            dict(optax_name="bv_sharding.scale_by_kron", scanned_layers="enc/.*"),
            ["config.scanned_layers regex 'enc/.*' names no param", "'img/w'"],
        ),
        (
            dict(optax_name="bv_sharding.scale_by_kron", scanned_layers=["img/.*"]),
            ["names 'img/w' of shape (2,)", "leave it out"],
        ),
        (
            dict(optax_name="bv_sharding.scale_by_shampoo", scanned_layers=3),
            ["config.scanned_layers=3", "regex"],
        ),
        (
            dict(optax_name="bv_sharding.scale_by_kron", optax=dict(scanned_layers="img/.*")),
            ["config.optax.scanned_layers='img/.*'", "config.scanned_layers instead"],
        ),
        (dict(optax_name=None), ["config.optax_name=None: name the optimizer"]),
        (dict(optax_name=...), ["config.optax_name=None: name the optimizer"]),  # No key.
        (dict(optax="b1=0.9"), ["config.optax='b1=0.9': must be a dict"]),
        (
            dict(optax_name="bv_sharding.scale_by_kron", optax=dict(block_size="x")),
            ["block_size='x' is not a number"],
        ),
        (
            dict(optax_name="bv_sharding.scale_by_shampoo", optax=dict(block_size=2.5)),
            ["block_size=2.5 must be an integer"],
        ),
        (
            dict(optax_name="bv_sharding.scale_by_soap", optax=dict(betas=0.9)),
            ["betas=0.9 must be 2 finite numbers, like (0.95, 0.95)"],
        ),
        (
            dict(optax_name="bv_sharding.scale_by_soap", optax=dict(eps=float("nan"))),
            ["eps=nan is not a number (the default is 1e-08)"],
        ),
        (
            dict(schedule=[("(", dict(decay_type="cosine")), (".*", None)]),
            ["config.schedule regex '(' does not compile"],
        ),
    ],
)
def test_section_mistakes_raise_the_librarys_error_naming_the_fix(values, fragments):
  config = {
      k: v for k, v in {**dict(optax_name="scale_by_adam", lr=1.0), **values}.items() if v != ...
  }
  params = {"img": {"w": jnp.ones(2)}, "txt": {"w": jnp.ones(2)}}
  with pytest.raises(bvs.big_vision.ConfigError) as info:
    bv_optax.make(config, params, sched_kw=dict(total_steps=10))
  assert isinstance(info.value, bvs.Error)
  for fragment in fragments:
    assert fragment in str(info.value), str(info.value)


@pytest.mark.parametrize("optimizer", ["kron", "shampoo", "muon"])
def test_make_moves_nothing_to_a_device_as_train_py_disallows_transfers(optimizer):
  """big_vision's ``train.py`` sets ``jax_transfer_guard`` to ``"disallow"`` before ``make``."""
  name, kwargs, lr = OPTIMIZERS[optimizer]
  config = dict(optax_name=name, optax=kwargs, lr=lr, mesh=[("data", -1)])
  params = {
      "w": jax.ShapeDtypeStruct((64, 32), jnp.float32),
      "b": jax.ShapeDtypeStruct((32,), jnp.float32),
  }
  with jax.transfer_guard("disallow"):
    tx, _ = bv_optax.make(config, params, sched_kw=dict(total_steps=4))
    opt_shape = jax.eval_shape(tx.init, params)
  assert bv_optax.get_count(jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), opt_shape)) == 0


# The five names at the library's defaults, in big_vision's convention: config.lr is AdamW's,
# times the constant the library publishes where an optimizer needs another (SOAP's LR_SCALE).
DEFAULTS = {
    "adam": ("scale_by_adam", 1.0),
    "kron": ("bv_sharding.scale_by_kron", 1.0),
    "shampoo": ("bv_sharding.scale_by_shampoo", 1.0),
    "soap": ("bv_sharding.scale_by_soap", SOAP_LR_SCALE),
    "muon": ("bv_sharding.scale_by_muon", 1.0),
}
DEFAULT_STEPS = 12
# big_vision's train.py sets the guard globally, after its imports and before make: it then
# reaches every thread, such as the one SOAP draws its fixed probe matrix on (soap._probe,
# cached per process: this process's earlier SOAP tests would have drawn it already).
GUARDED_FLOWS = """
import importlib
import sys

import jax

jax.config.update("jax_num_cpu_devices", 8)
from tests.library import test_big_vision_dropin as dropin

importlib.import_module("bv_sharding.optimizers.soap")._probe.cache_clear()
jax.config.update("jax_transfer_guard", "disallow")
for optimizer in sys.argv[1:]:
  print(optimizer, *dropin.default_losses(optimizer), flush=True)
"""


def default_losses(optimizer: str) -> list[float]:
  """The losses of :data:`DEFAULT_STEPS` steps of big_vision's flow of ``DEFAULTS[optimizer]``
  on :class:`TinyViT` at AdamW's lr 1e-3 (times the published constant), every other key at
  big_vision's default (a constant schedule, no clipping, no weight decay) and the
  optimizer's arguments at the library's (:data:`GUARDED_FLOWS` runs it under ``train.py``'s
  transfer guard)."""
  name, lr_scale = DEFAULTS[optimizer]
  model = TinyViT()
  config = dict(
      optax_name=name,
      lr=1e-3 * lr_scale,
      mesh=[("data", -1)],
      sharding_strategy=[(".*", 'fsdp(axis="data", min_size_to_shard_mb=0)')],
      sharding_rules=[("act_batch", "data")],
  )
  example = jax.ShapeDtypeStruct((16, 16, 16, 3), jnp.float32)
  flow = train_state_flow(
      config, model, example, _batch(0), _classifier_loss(model), mesh_of(config), DEFAULT_STEPS
  )
  return flow.losses


@pytest.mark.timeout(300)
def test_every_name_trains_at_its_defaults_under_train_pys_global_transfer_guard():
  """The five names at the library's defaults compile and train 12 steps at lr 1e-3 (SOAP's
  times its published ``LR_SCALE``), each lowering the loss by at least 10%, in a fresh
  process that disallows every implicit transfer globally, as ``train.py`` does (the
  thread-local ``jax.transfer_guard`` of the test above does not reach the threads the
  optimizers start)."""
  done = subprocess.run(
      [sys.executable, "-c", GUARDED_FLOWS, *sorted(DEFAULTS)],
      cwd=helpers.ROOT,
      env=helpers.environment(),
      capture_output=True,
      text=True,
      timeout=280,
  )
  assert done.returncode == 0, done.stderr[-4000:]
  rows = [line.split() for line in done.stdout.strip().split("\n")]
  losses = {optimizer: [float(x) for x in values] for optimizer, *values in rows}
  assert sorted(losses) == sorted(DEFAULTS), done.stdout
  for optimizer, trajectory in losses.items():
    assert len(trajectory) == DEFAULT_STEPS, (optimizer, trajectory)
    assert np.all(np.isfinite(trajectory)), (optimizer, trajectory)
    assert trajectory[-1] <= 0.9 * trajectory[0], (optimizer, trajectory)
