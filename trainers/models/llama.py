"""Llama-style decoder-only language model (RoPE, causal attention, SwiGLU).

Parameter names are part of the API: sharding rules match them as path
components. Every parameter is boxed with ``nn.with_logical_partitioning``:

  embed/embedding                  (vocab, d_model)        ("vocab", "embed")
  layers_{i}/attention_norm/scale  (d_model,)              ("norm",)
  layers_{i}/attention/q_kernel    (d_model, heads*hd)     ("embed", "heads")
  layers_{i}/attention/k_kernel    (d_model, heads*hd)     ("embed", "heads")
  layers_{i}/attention/v_kernel    (d_model, heads*hd)     ("embed", "heads")
  layers_{i}/attention/out_kernel  (heads*hd, d_model)     ("heads", "embed")
  layers_{i}/mlp_norm/scale        (d_model,)              ("norm",)
  layers_{i}/mlp/gate_kernel       (d_model, d_ff)         ("embed", "mlp")
  layers_{i}/mlp/up_kernel         (d_model, d_ff)         ("embed", "mlp")
  layers_{i}/mlp/down_kernel       (d_ff, d_model)         ("mlp", "embed")
  final_norm/scale                 (d_model,)              ("norm",)
  lm_head/kernel                   (d_model, vocab)        ("embed", "vocab")

With ``scan_layers=True`` the blocks live under a single ``layers/...`` subtree and
every per-layer parameter gets a leading axis of size n_layers named "layers",
e.g. layers/attention/q_kernel has shape (n_layers, d_model, heads*hd) and
logical axes ("layers", "embed", "heads").

The output head is untied from the input embedding (``lm_head/kernel``).

Activations are constrained (:func:`trainers.models.axes.constrain`) using the names
of :mod:`trainers.models.axes` ("act_batch", "act_len", "act_embed", "act_heads",
"act_mlp", "act_vocab"); outside an ``nn.logical_axis_rules`` context these are no-ops.
On a mesh with Explicit axes they reshard, and the row-parallel products (``out_kernel``,
``down_kernel``) and the embedding lookup are told their output sharding.

Params are stored in ``param_dtype`` and cast to the compute ``dtype`` for the matmuls
(``config.param_dtype``, ``config.compute_dtype``); whatever the dtypes, RoPE's angles,
the attention softmax and the RMSNorm statistics are computed in float32, and the logits
come out in float32 so the loss reduces in float32.

Example:
  >>> model = build("tiny", scan_layers=True)
  >>> tokens = jnp.zeros((2, 16), jnp.int32)
  >>> params = model.init(jax.random.key(0), tokens)["params"]
  >>> model.apply({"params": params}, tokens).shape
  (2, 16, 256)
"""

import dataclasses
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

import bv_sharding as bvs
from trainers.models import _presets
from trainers.models.axes import (
    ACT_EMBED,
    ACT_HEADS,
    ACT_MLP,
    ACT_VOCAB,
    LAYERS,
    constrain,
    matmul,
    take,
)


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  """Architecture hyper-parameters; see ``PRESETS`` for named sizes."""

  vocab_size: int
  d_model: int
  n_layers: int
  n_heads: int
  d_ff: int
  max_len: int  # Default training sequence length; RoPE itself is unbounded.
  rope_theta: float = 10_000.0
  norm_eps: float = 1e-6

  @property
  def head_dim(self) -> int:
    return self.d_model // self.n_heads


# Byte-level presets (vocab 256) train on CPU; "125m"/"1b"/"7b" are Llama-shaped. "1b"
# (1,055,991,808 params) trains on one 80-141 GiB accelerator: adamw's fp32 params, grads
# and moments take 15.7 GiB (11.8 GiB with bfloat16 state), leaving the rest for activations.
# On one 16 GiB chip (TPU v5e), params and state in bfloat16 with 16 microbatches of batch 16 x
# 2048: 15.50 GiB compiled, 9,255 tokens/s (docs/hardware.md, "The 1b preset on one 16 GiB chip").
PRESETS = {
    "tiny": LlamaConfig(vocab_size=256, d_model=128, n_layers=2, n_heads=4, d_ff=384, max_len=128),
    "small": LlamaConfig(vocab_size=256, d_model=256, n_layers=4, n_heads=4, d_ff=768, max_len=256),
    "medium": LlamaConfig(
        vocab_size=256, d_model=512, n_layers=8, n_heads=8, d_ff=1536, max_len=512
    ),
    "125m": LlamaConfig(
        vocab_size=32_000, d_model=768, n_layers=12, n_heads=12, d_ff=2048, max_len=2048
    ),
    "1b": LlamaConfig(
        vocab_size=32_000, d_model=2048, n_layers=18, n_heads=16, d_ff=5632, max_len=2048
    ),
    "7b": LlamaConfig(
        vocab_size=32_000, d_model=4096, n_layers=32, n_heads=32, d_ff=11_008, max_len=4096
    ),
}


def llama_config(size: str, **overrides) -> LlamaConfig:
  """Returns the preset ``size``, with any field replaced by ``overrides``.

  Example:
    >>> llama_config("tiny", n_layers=4).n_layers
    4
  """
  return _presets.pick(PRESETS, size, **overrides)


def _kernel(module: nn.Module, name: str, shape: tuple[int, int], axes: tuple[str, str]):
  """Declares a 2-D lecun-normal kernel ``name`` in ``module.param_dtype``; returns it cast
  to ``module.dtype``."""
  init = nn.with_logical_partitioning(nn.initializers.lecun_normal(), axes)
  return module.param(name, init, shape, module.param_dtype).astype(module.dtype)


def _rms_norm(name: str, module: nn.Module) -> nn.RMSNorm:
  """RMSNorm (statistics in float32) whose ``scale`` param is boxed with logical axes ("norm",)."""
  return nn.RMSNorm(
      epsilon=module.config.norm_eps,
      dtype=module.dtype,
      param_dtype=module.param_dtype,
      name=name,
      scale_init=nn.with_logical_partitioning(nn.initializers.ones, ("norm",)),
  )


def apply_rope(x: jax.Array, theta: float, start=0) -> jax.Array:
  """Rotary position embedding ("rotate half" form) of x: (B, T, heads, hd) at positions
  ``start``, ``start + 1``, ... (``start`` may be traced: a KV cache's fill).

  Position t is rotated by angles ``t * theta ** (-i / (hd / 2))``; position 0 is unchanged.

  Example:
    >>> x = jnp.ones((1, 3, 1, 4))
    >>> bool(jnp.allclose(apply_rope(x, 10_000.0)[:, 0], x[:, 0]))
    True
  """
  half = x.shape[-1] // 2
  freqs = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
  positions = jnp.arange(x.shape[1], dtype=jnp.float32) + jnp.asarray(start, jnp.float32)
  angles = positions[:, None] * freqs
  sin = jnp.sin(angles)[None, :, None, :]
  cos = jnp.cos(angles)[None, :, None, :]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)
  return rotated.astype(x.dtype)


class _Embed(nn.Embed):
  """``nn.Embed`` whose lookup comes out as the token stream ``ACT_EMBED`` (``axes.take``)."""

  def __call__(self, inputs: jax.Array) -> jax.Array:
    return take(self.embedding.astype(self.dtype), inputs, ACT_EMBED)


class _Head(nn.Dense):
  """``nn.Dense`` (no bias) whose product comes out as the logits ``ACT_VOCAB`` (``axes.matmul``:
  on Explicit axes a kernel split over vocab that the rules keep whole is gathered first)."""

  @nn.compact
  def __call__(self, inputs: jax.Array) -> jax.Array:
    shape = (inputs.shape[-1], self.features)
    kernel = self.param("kernel", self.kernel_init, shape, self.param_dtype)
    return matmul(inputs, kernel.astype(self.dtype), ACT_VOCAB)


class _Layer(nn.Module):
  """What every layer of the model holds: the sizes, the compute and the params' dtypes, and
  whether it decodes with a KV cache (:class:`Llama`'s ``decode``)."""

  config: LlamaConfig
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32
  decode: bool = False


class Attention(_Layer):
  """Causal multi-head self-attention with RoPE on queries and keys.

  With ``decode``, keys and values go into the "cache" collection (``max_len`` positions,
  zeros until written) from its "index" on, and the queries attend to every cached position
  up to their own: feeding a prompt, then one token at a time, gives the logits a full pass
  over the whole sequence gives.
  """

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    cfg = self.config
    inner = cfg.n_heads * cfg.head_dim

    def project(name):
      kernel = _kernel(self, name, (cfg.d_model, inner), ("embed", "heads"))
      y = (x @ kernel).reshape(*x.shape[:2], cfg.n_heads, cfg.head_dim)
      return constrain(y, ACT_HEADS)

    q, k, v = project("q_kernel"), project("k_kernel"), project("v_kernel")
    if self.decode:
      shape = (x.shape[0], cfg.max_len, cfg.n_heads, cfg.head_dim)
      keys = self.variable("cache", "k", jnp.zeros, shape, k.dtype)
      values = self.variable("cache", "v", jnp.zeros, shape, v.dtype)
      index = self.variable("cache", "index", lambda: jnp.zeros((), jnp.int32))
      start = index.value
      q, k = apply_rope(q, cfg.rope_theta, start), apply_rope(k, cfg.rope_theta, start)
      keys.value = jax.lax.dynamic_update_slice(keys.value, k, (0, start, 0, 0))
      values.value = jax.lax.dynamic_update_slice(values.value, v, (0, start, 0, 0))
      index.value = start + x.shape[1]
      seen = jnp.arange(cfg.max_len)[None, :] <= start + jnp.arange(x.shape[1])[:, None]
      y = jax.nn.dot_product_attention(q, keys.value, values.value, mask=seen[None, None])
    else:
      q, k = apply_rope(q, cfg.rope_theta), apply_rope(k, cfg.rope_theta)
      y = jax.nn.dot_product_attention(q, k, v, is_causal=True)  # Softmax in float32.
    y = y.reshape(*x.shape[:2], inner)
    out = _kernel(self, "out_kernel", (inner, cfg.d_model), ("heads", "embed"))
    return matmul(y, out, ACT_EMBED)


class Mlp(_Layer):
  """SwiGLU feed-forward: down(silu(x @ gate) * (x @ up))."""

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    cfg = self.config
    gate = _kernel(self, "gate_kernel", (cfg.d_model, cfg.d_ff), ("embed", "mlp"))
    up = _kernel(self, "up_kernel", (cfg.d_model, cfg.d_ff), ("embed", "mlp"))
    down = _kernel(self, "down_kernel", (cfg.d_ff, cfg.d_model), ("mlp", "embed"))
    h = constrain(nn.silu(x @ gate) * (x @ up), ACT_MLP)
    return matmul(h, down, ACT_EMBED)


class DecoderBlock(_Layer):
  """Pre-norm residual block; (x, _) -> (x, None) so it can be nn.scan'ned."""

  @nn.compact
  def __call__(self, x: jax.Array, _=None) -> tuple[jax.Array, None]:
    dtypes = (self.dtype, self.param_dtype)
    attention = Attention(self.config, *dtypes, decode=self.decode, name="attention")
    x = x + attention(_rms_norm("attention_norm", self)(x))
    x = x + Mlp(self.config, *dtypes, name="mlp")(_rms_norm("mlp_norm", self)(x))
    return constrain(x, ACT_EMBED), None


class Llama(nn.Module):
  """Decoder LM: int tokens (B, T) -> float32 logits (B, T, vocab).

  Attributes:
    config: architecture sizes.
    scan_layers: stack the blocks with nn.scan (per-layer params get a leading
      "layers" axis; compile time no longer grows with depth).
    remat: rematerialise each block's activations in the backward pass.
    dtype: activation / compute dtype (params are cast to it for the matmuls).
    param_dtype: the params' stored dtype.
    gather_layer: with ``scan_layers``, a function of one layer's params (its slice of
      the ``layers`` stack) applied where the scanned body reads them, e.g. to gather them
      for compute one layer at a time (``trainers.build.loss_fn`` passes
      ``bv_sharding.gather_for_compute``); ``None`` reads them as they are.
    decode: decode with a KV cache (``model.clone(decode=True)``, applied with
      ``mutable=["cache"]``): each call continues the sequence the cache holds, up to
      ``config.max_len`` positions (trainers/sample.py).
  """

  config: LlamaConfig
  scan_layers: bool = False
  remat: bool = False
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32
  gather_layer: Callable[[Any], Any] | None = None
  decode: bool = False

  STACK = "layers"  # The path of the scanned layers' params (scan_layers=True).

  def _block(self):
    """The decoder block as the model runs it. On a scanned stack with ``gather_layer`` the
    block gathers its params where it reads them, inside the rematerialised part: the
    backward pass gathers each layer again (without ``remat``, only the gathers are
    recomputed: ``bv_sharding.save_anything_but_gathers``), so no layer's gathered params
    are kept from the forward pass."""
    block = DecoderBlock
    gathers = self.scan_layers and self.gather_layer is not None
    if gathers:
      gather = lambda variables: {"params": self.gather_layer(variables["params"])}
      block = nn.map_variables(block, "params", trans_in_fn=gather)
    if self.remat:
      block = nn.remat(block, prevent_cse=not self.scan_layers)
    elif gathers:
      block = nn.remat(block, prevent_cse=False, policy=bvs.save_anything_but_gathers)
    return block

  @nn.compact
  def __call__(self, tokens: jax.Array) -> jax.Array:
    cfg = self.config
    embed = _Embed(
        cfg.vocab_size,
        cfg.d_model,
        dtype=self.dtype,
        param_dtype=self.param_dtype,
        name="embed",
        embedding_init=nn.with_logical_partitioning(
            nn.initializers.normal(stddev=0.02), ("vocab", "embed")
        ),
    )
    x = embed(tokens)
    dtypes = (self.dtype, self.param_dtype)

    block = self._block()
    if self.scan_layers:
      layers = nn.scan(
          block,
          length=cfg.n_layers,
          variable_axes={"params": 0, "cache": 0},
          split_rngs={"params": True},
          metadata_params={nn.PARTITION_NAME: LAYERS},
      )
      x, _ = layers(cfg, *dtypes, decode=self.decode, name=self.STACK)(x, None)
    else:
      for i in range(cfg.n_layers):
        x, _ = block(cfg, *dtypes, decode=self.decode, name=f"layers_{i}")(x, None)

    x = _rms_norm("final_norm", self)(x)
    logits = _Head(
        cfg.vocab_size,
        use_bias=False,
        dtype=self.dtype,
        param_dtype=self.param_dtype,
        name="lm_head",
        kernel_init=nn.with_logical_partitioning(
            nn.initializers.lecun_normal(), ("embed", "vocab")
        ),
    )(x)
    return constrain(logits.astype(jnp.float32), ACT_VOCAB)


def build(
    size: str = "tiny",
    *,
    scan_layers: bool = False,
    remat: bool = False,
    dtype: Any = jnp.float32,
    param_dtype: Any = jnp.float32,
    **config_overrides,
) -> Llama:
  """Returns a ``Llama`` of preset ``size``; extra kwargs override config fields.

  ``dtype``: the compute dtype; ``param_dtype``: the params' (names like "bfloat16" too).

  Example:
    >>> build("tiny", scan_layers=True, n_layers=4, dtype=jnp.bfloat16).config.n_layers
    4
  """
  return Llama(
      llama_config(size, **config_overrides),
      scan_layers=scan_layers,
      remat=remat,
      dtype=dtype,
      param_dtype=param_dtype,
  )
