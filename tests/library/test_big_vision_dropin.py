"""``bv_sharding.big_vision`` in place of big_vision's ``sharding`` and ``optax`` imports.

The flow is big_vision's ``train.py`` (shapes with ``jax.eval_shape``, ``bv_optax.make``,
``bv_sharding.infer_sharding`` under ``nn.logical_axis_rules``, both inits jitted into the
inferred shardings, an update step counting with ``get_count``) on a small ViT-like model
with 3-D and 4-D params; the placements and the optimizer trajectories are big_vision's own,
recorded as data by ``tools/record_big_vision.py`` (none of its code is here).
"""

import functools
import importlib.util
import json
import pathlib

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


@pytest.mark.parametrize("mesh_axes", [[("data", -1)], [("data", 4), ("model", 2)]])
def test_big_visions_train_state_flow_with_adam_loss_falls(mesh_axes):
  model, steps = TinyViT(), 6
  config = dict(
      optax_name="scale_by_adam",
      optax=dict(b2=0.95),
      lr=3e-3,
      wd=1e-4,
      grad_clip_norm=1.0,
      schedule=dict(decay_type="cosine", warmup_steps=1),
  )

  def init(rng):
    return model.init(rng, jnp.zeros((16, 16, 16, 3)))["params"]

  names, sizes = zip(*mesh_axes)
  model_axis = "model" if "model" in names else None
  rules = [(logical, axis if axis != "model" else model_axis) for logical, axis in RULES]
  rng = jax.random.key(0)
  params_shape = jax.eval_shape(init, rng)
  tx, sched_fns = bv_optax.make(
      config, nn.unbox(params_shape), sched_kw=dict(total_steps=steps, batch_size=16)
  )
  opt_shape = jax.eval_shape(tx.init, params_shape)
  devices = np.array(jax.devices()).reshape(np.array(jax.devices()).reshape(sizes).shape)
  mesh = jax.sharding.Mesh(devices, names)
  repl = NamedSharding(mesh, P())
  with nn.logical_axis_rules(rules):
    shardings = bv_sharding.infer_sharding(
        {"params": params_shape, "opt": opt_shape}, strategy=STRATEGY, mesh=mesh
    )
  params = jax.jit(init, out_shardings=shardings["params"])(rng)
  opt = jax.jit(tx.init, out_shardings=shardings["opt"])(params)
  state = nn.unbox({"params": params, "opt": opt})

  specs = jax.tree.map(lambda x: x.sharding.spec, state["params"])
  # (32, 64): "mlp" -> "model" by the rules, then fsdp takes the largest free dim.
  mlp_in = P("data", "model") if model_axis else P(None, "data")
  assert specs["mlp_in"]["kernel"] == mlp_in
  assert specs["embedding"]["kernel"] == P(None, None, None, "data")  # 4-D: (4, 4, 3, 32)
  assert specs["attention"]["query"]["kernel"][0] == "data"  # 3-D: (32, 4, 8)
  mu = bv_optax.find_states(state["opt"], optax.ScaleByAdamState)[0].mu
  assert jax.tree.map(lambda x: x.sharding.spec, mu) == specs  # state follows its params

  def loss_fn(p, images, labels):
    logits = model.apply({"params": p}, images)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

  @functools.partial(jax.jit, donate_argnums=(0,), out_shardings=(shardings, repl))
  def update_fn(train_state, images, labels):
    count = bv_optax.get_count(train_state["opt"], jittable=True)
    loss, grads = jax.value_and_grad(loss_fn)(train_state["params"], images, labels)
    updates, opt = tx.update(grads, train_state["opt"], train_state["params"])
    params = optax.apply_updates(train_state["params"], updates)
    return {"params": params, "opt": opt}, {"loss": loss, "count": count}

  images, labels = _batch(0)
  losses = []
  for step in range(steps):
    state, measured = update_fn(state, images, labels)
    assert int(measured["count"]) == step
    losses.append(float(measured["loss"]))
  assert bv_optax.get_count(state["opt"]) == steps
  assert losses[-1] < 0.8 * losses[0], losses
  assert float(sched_fns[0](1)) == pytest.approx(1.0)
  assert state["params"]["mlp_in"]["kernel"].sharding.spec == mlp_in


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
            dict(optax_name="bv_sharding.scale_by_kron"),
            ["'bv_sharding.scale_by_kron'", "library's"],
        ),
        (dict(optax_name="scale_by_adamm"), ["neither", "did you mean 'scale_by_adam'"]),
        (dict(optax=dict(beta2=0.9)), ["Signature: scale_by_adam("]),
        (dict(schedule=[("img/.*", {})]), ["'txt/w' matches no regex of config.schedule"]),
        (dict(optim=dict(name="adam")), ["config.optim was retired", "config.optax"]),
        (dict(weight_decay=0.1), ["config.weight_decay was retired", "config.wd"]),
        (dict(lr_mults=[(".*", 0.0)]), ["must be > 0", "(regex, None)"]),
        (dict(wd=0.1, wd_mults=[("/.*", 1.0)]), ["config.wd_mults regex '/.*'", "write '.*'"]),
        (dict(schedule=dict(decay_typ="cosine")), ["did you mean 'decay_type'"]),
    ],
)
def test_section_mistakes_raise_the_librarys_error_naming_the_fix(values, fragments):
  config = {**dict(optax_name="scale_by_adam", lr=1.0), **values}
  params = {"img": {"w": jnp.ones(2)}, "txt": {"w": jnp.ones(2)}}
  with pytest.raises(bvs.big_vision.ConfigError) as info:
    bv_optax.make(config, params, sched_kw=dict(total_steps=10))
  assert isinstance(info.value, bvs.Error)
  for fragment in fragments:
    assert fragment in str(info.value), str(info.value)
