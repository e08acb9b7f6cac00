"""Tests for trainers.models: parameter names/shapes, partitioning, forward."""

import importlib

import flax.linen as nn
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from trainers import models
from trainers.errors import ConfigError
from trainers.models import llama

SEQ = 16
D, FF, VOCAB, LAYERS = 128, 384, 256, 2  # The "tiny" preset.

PER_LAYER_SHAPES = {
    "attention/q_kernel": (D, D),
    "attention/k_kernel": (D, D),
    "attention/v_kernel": (D, D),
    "attention/out_kernel": (D, D),
    "attention_norm/scale": (D,),
    "mlp/gate_kernel": (D, FF),
    "mlp/up_kernel": (D, FF),
    "mlp/down_kernel": (FF, D),
    "mlp_norm/scale": (D,),
}
GLOBAL_SHAPES = {
    "embed/embedding": (VOCAB, D),
    "final_norm/scale": (D,),
    "lm_head/kernel": (D, VOCAB),
}


def _tokens(batch=2, seed=0):
  return jax.random.randint(jax.random.key(seed), (batch, SEQ), 0, VOCAB)


def _boxed_leaves(params):
  """{"a/b/c": leaf} keeping nn.Partitioned boxes as leaves."""
  is_box = lambda x: isinstance(x, nn.Partitioned)
  return {
      jax.tree_util.keystr(path, simple=True, separator="/"): leaf
      for path, leaf in jax.tree_util.tree_leaves_with_path(params, is_leaf=is_box)
  }


def _abstract_params(model):
  return jax.eval_shape(model.init, jax.random.key(0), _tokens())["params"]


def _stack_layers(params):
  """Unscanned tiny llama params -> the scan_layers=True layout."""
  layers = [params[f"layers_{i}"] for i in range(LAYERS)]
  stacked = {k: v for k, v in params.items() if not k.startswith("layers_")}
  stacked["layers"] = jax.tree.map(lambda *xs: jnp.stack(xs), *layers)
  return stacked


def _logits(model, params, tokens):
  return jax.jit(model.apply)({"params": params}, tokens)


@pytest.fixture(scope="module")
def params():
  """Unboxed params of the unscanned tiny llama (initialised once)."""
  model = llama.build("tiny")
  return nn.unbox(jax.jit(model.init)(jax.random.key(0), _tokens())["params"])


def test_llama_unscanned_param_tree():
  leaves = _boxed_leaves(_abstract_params(llama.build("tiny")))
  expected = dict(GLOBAL_SHAPES)
  for i in range(LAYERS):
    expected.update({f"layers_{i}/{k}": v for k, v in PER_LAYER_SHAPES.items()})
  assert {k: v.value.shape for k, v in leaves.items()} == expected


def test_llama_scanned_param_tree_has_leading_layer_axis():
  leaves = _boxed_leaves(_abstract_params(llama.build("tiny", scan_layers=True)))
  expected = dict(GLOBAL_SHAPES)
  expected.update({f"layers/{k}": (LAYERS, *v) for k, v in PER_LAYER_SHAPES.items()})
  assert {k: v.value.shape for k, v in leaves.items()} == expected


@pytest.mark.parametrize("scan_layers", [False, True])
def test_llama_params_are_logically_partitioned(scan_layers):
  leaves = _boxed_leaves(_abstract_params(llama.build("tiny", scan_layers=scan_layers)))
  for path, box in leaves.items():
    assert isinstance(box, nn.LogicallyPartitioned), path
    assert len(box.names) == box.value.ndim, path
    assert (box.names[0] == "layers") == (scan_layers and path.startswith("layers/")), path
  assert leaves["embed/embedding"].names == ("vocab", "embed")
  assert leaves["lm_head/kernel"].names == ("embed", "vocab")
  assert leaves["final_norm/scale"].names == ("norm",)


def test_llama_forward_shape_and_dtype(params):
  logits = _logits(llama.build("tiny", dtype=jnp.bfloat16), params, _tokens(batch=3))
  assert logits.shape == (3, SEQ, VOCAB)
  assert logits.dtype == jnp.float32
  assert np.isfinite(logits).all()


def test_llama_is_causal(params):
  tokens = _tokens()
  t = SEQ // 2
  changed = tokens.at[:, t].set((tokens[:, t] + 1) % VOCAB)
  logits = _logits(llama.build("tiny"), params, jnp.concatenate([tokens, changed]))
  before, after = jnp.split(logits, 2)
  np.testing.assert_array_equal(before[:, :t], after[:, :t])
  assert not np.allclose(before[:, t:], after[:, t:])


def test_scanned_matches_unscanned_with_stacked_params(params):
  tokens = _tokens()
  np.testing.assert_allclose(
      _logits(llama.build("tiny", scan_layers=True), _stack_layers(params), tokens),
      _logits(llama.build("tiny"), params, tokens),
      rtol=1e-5,
      atol=1e-5,
  )


@pytest.mark.parametrize("scan_layers", [False, True])
def test_decoding_with_the_kv_cache_gives_the_full_pass_logits(params, scan_layers):
  """A prompt of 5 tokens, then one token at a time (trainers.sample's use), against one pass."""
  tokens = _tokens(batch=1)
  weights = _stack_layers(params) if scan_layers else params
  model = llama.build("tiny", scan_layers=scan_layers)
  # A scanned stack as trainers.sample runs it: each layer read through gather_layer.
  decoding = model.clone(decode=True, gather_layer=(lambda p: p) if scan_layers else None)
  decoder = jax.jit(
      lambda cache, x: decoding.apply({"params": weights, **cache}, x, mutable=["cache"])
  )
  logits, cache = decoder({}, tokens[:, :5])
  pieces = [logits]
  for t in range(5, SEQ):
    logits, cache = decoder(cache, tokens[:, t : t + 1])
    pieces.append(logits)
  np.testing.assert_allclose(
      jnp.concatenate(pieces, 1), _logits(model, weights, tokens), rtol=1e-5, atol=1e-5
  )
  flat = jax.tree_util.tree_leaves_with_path(cache)
  index = [leaf for path, leaf in flat if "index" in jax.tree_util.keystr(path)]
  assert {int(np.max(i)) for i in index} == {SEQ}  # Every layer's cache holds the sequence.


@pytest.mark.parametrize("scan_layers", [False, True])
def test_remat_gives_same_loss_and_grads(params, scan_layers):
  if scan_layers:
    params = _stack_layers(params)
  tokens = _tokens()

  def loss_and_grad(remat):
    model = llama.build("tiny", scan_layers=scan_layers, remat=remat)
    loss = lambda p: model.apply({"params": p}, tokens).mean()
    return jax.jit(jax.value_and_grad(loss))(params)

  (loss_plain, g_plain), (loss_remat, g_remat) = map(loss_and_grad, (False, True))
  np.testing.assert_allclose(loss_plain, loss_remat, rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), g_plain, g_remat)


def test_activation_constraints_apply_under_rules_and_mesh(params):
  model = llama.build("tiny")
  tokens = _tokens(batch=jax.device_count())
  mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  with jax.set_mesh(mesh), nn.logical_axis_rules([("act_batch", "data")]):
    apply = jax.jit(model.apply)
    hlo = apply.lower({"params": params}, tokens).as_text()
    logits = apply({"params": params}, tokens)
  assert "sharding_constraint" in hlo and '"data"' in hlo
  np.testing.assert_allclose(logits, _logits(model, params, tokens), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("size,expected", [("125m", 134e6), ("1b", 1.056e9), ("7b", 6.74e9)])
def test_llama_preset_sizes(size, expected):
  params = _abstract_params(llama.build(size, scan_layers=True))
  count = sum(x.size for x in jax.tree.leaves(nn.unbox(params)))
  assert abs(count - expected) / expected < 0.01


def test_llama_config_overrides_and_unknown_size():
  assert llama.llama_config("tiny", n_layers=4).n_layers == 4
  with pytest.raises(ValueError, match="tiny"):
    llama.llama_config("huge")


def test_vit_param_names_and_forward():
  model = models.get_model("vit", size="tiny", num_classes=10)
  images = jnp.ones((2, 8, 8, 1))
  logits, variables = jax.jit(model.init_with_output)(jax.random.key(0), images)
  params = variables["params"]
  assert set(params) == {"embedding", "cls", "pos_embedding", "Transformer", "head"}
  assert set(params["Transformer"]) == {"encoderblock_0", "encoderblock_1", "encoder_norm"}
  block = params["Transformer"]["encoderblock_0"]
  assert set(block) == {
      "LayerNorm_0",
      "LayerNorm_1",
      "MlpBlock_0",
      "MultiHeadDotProductAttention_0",
  }
  assert block["MlpBlock_0"]["Dense_0"]["kernel"].shape == (64, 256)
  assert params["pos_embedding"].shape == (1, 16, 64)
  assert params["head"]["kernel"].shape == (64, 10)
  assert logits.shape == (2, 10)


def test_get_model_registry():
  assert isinstance(models.get_model("llama", size="tiny"), llama.Llama)
  with pytest.raises(ConfigError, match="llama.*vit"):
    models.get_model("resnet")
  assert issubclass(ConfigError, ValueError)


def _dot_dtypes(model, variables, x) -> set[str]:
  """The operand dtypes of every matmul the model's forward pass traces."""
  jaxpr = jax.make_jaxpr(model.apply)(variables, x)
  eqns = list(jaxpr.eqns)
  for eqn in eqns:  # Nested jaxprs (pjit, custom_jvp) hold the model's dots too.
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      eqns.extend(sub.eqns)
  return {str(v.aval.dtype) for e in eqns if e.primitive.name == "dot_general" for v in e.invars}


@pytest.mark.parametrize("config_name", ["lm", "vit_digits"])
@pytest.mark.parametrize("compute, param", [("bfloat16", "float32"), ("float32", "bfloat16")])
def test_config_dtypes_set_the_params_and_the_matmuls_and_logits_stay_float32(
    config_name, compute, param
):
  config = importlib.import_module(f"configs.{config_name}").get_config()
  config.compute_dtype, config.param_dtype = compute, param
  model = models.from_config(config)
  x = jnp.zeros((2, SEQ), jnp.int32) if config_name == "lm" else jnp.zeros((2, 8, 8, 1))
  variables = nn.unbox(jax.eval_shape(model.init, jax.random.key(0), x))
  assert {str(p.dtype) for p in jax.tree.leaves(variables)} == {param}
  assert jax.eval_shape(model.apply, variables, x).dtype == jnp.float32
  dots = _dot_dtypes(model, variables, x)
  # ViT multiplies the float32 attention probabilities with the values in float32 (flax's
  # force_fp32_for_softmax); every other matmul, and all of Llama's, in the compute dtype.
  assert dots == {compute} if config_name == "lm" else dots == {compute, "float32"}
