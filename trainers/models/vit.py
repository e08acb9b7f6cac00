"""Small Vision Transformer with big_vision's parameter names.

Parameter tree (as in big_vision/models/vit.py, classifier-token pooling):

  embedding/{kernel,bias}          patch-embedding nn.Conv
  pos_embedding                    (1, num_patches, width), learned
  cls                              (1, 1, width), classifier token
  Transformer/encoderblock_{i}/LayerNorm_0, LayerNorm_1
  Transformer/encoderblock_{i}/MultiHeadDotProductAttention_0/{query,key,value,out}
  Transformer/encoderblock_{i}/MlpBlock_0/Dense_0, Dense_1
  Transformer/encoder_norm
  head/{kernel,bias}               zero-initialised classifier

Params are plain arrays (not logically boxed), like big_vision's; the token
stream is constrained to ``trainers.models.axes.ACT_EMBED`` ("act_batch", "act_len",
"act_embed"). Params are stored in ``param_dtype`` and computed with in ``dtype``
(``config.param_dtype``, ``config.compute_dtype``); the attention softmax (and so its
product with the values: flax's ``force_fp32_for_softmax``) and the LayerNorm statistics
run in float32, and the logits come out in float32.

Example:
  >>> model = build("tiny", num_classes=10)
  >>> images = jnp.zeros((2, 8, 8, 1))
  >>> params = model.init(jax.random.key(0), images)["params"]
  >>> model.apply({"params": params}, images).shape
  (2, 10)
"""

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from trainers.models import _presets
from trainers.models.axes import ACT_EMBED, constrain


@dataclasses.dataclass(frozen=True)
class ViTConfig:
  """Encoder sizes; see ``PRESETS``."""

  width: int
  depth: int
  mlp_dim: int
  num_heads: int
  patch_size: int


# Sized for 8x8 images (e.g. sklearn digits): patch 2 -> 16 tokens + cls.
PRESETS = {
    "tiny": ViTConfig(width=64, depth=2, mlp_dim=256, num_heads=4, patch_size=2),
    "small": ViTConfig(width=192, depth=6, mlp_dim=768, num_heads=3, patch_size=2),
}


def vit_config(size: str, **overrides) -> ViTConfig:
  """Returns the preset ``size`` with fields replaced by ``overrides``.

  Example:
    >>> vit_config("tiny", depth=4).depth
    4
  """
  return _presets.pick(PRESETS, size, **overrides)


class _Layer(nn.Module):
  """What every layer holds: the compute and the params' dtypes (keyword arguments)."""

  dtype: Any = dataclasses.field(default=jnp.float32, kw_only=True)
  param_dtype: Any = dataclasses.field(default=jnp.float32, kw_only=True)

  @property
  def dtypes(self) -> dict[str, Any]:
    """The ``dtype``/``param_dtype`` keyword arguments of flax's layers."""
    return dict(dtype=self.dtype, param_dtype=self.param_dtype)


class MlpBlock(_Layer):
  """Dense -> GELU -> Dense, back to the input width."""

  mlp_dim: int

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    dense = lambda n: nn.Dense(
        n,
        **self.dtypes,
        kernel_init=nn.initializers.xavier_uniform(),
        bias_init=nn.initializers.normal(stddev=1e-6),
    )
    h = nn.gelu(dense(self.mlp_dim)(x))  # Dense_0
    return dense(x.shape[-1])(h)  # Dense_1


class Encoder1DBlock(_Layer):
  """Pre-LayerNorm self-attention + MLP residual block."""

  mlp_dim: int
  num_heads: int

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    y = nn.LayerNorm(**self.dtypes)(x)
    x = x + nn.MultiHeadDotProductAttention(
        num_heads=self.num_heads,
        **self.dtypes,
        kernel_init=nn.initializers.xavier_uniform(),
        force_fp32_for_softmax=True,
    )(y, y)
    x = x + MlpBlock(self.mlp_dim, **self.dtypes)(nn.LayerNorm(**self.dtypes)(x))
    return constrain(x, ACT_EMBED)


class Encoder(_Layer):
  """``depth`` blocks named ``encoderblock_{i}``, then ``encoder_norm``."""

  config: ViTConfig

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    cfg = self.config
    for i in range(cfg.depth):
      block = Encoder1DBlock(cfg.mlp_dim, cfg.num_heads, **self.dtypes, name=f"encoderblock_{i}")
      x = block(x)
    return nn.LayerNorm(**self.dtypes, name="encoder_norm")(x)


class ViT(_Layer):
  """Images (B, H, W, C) -> float32 logits (B, num_classes), pooled on the cls token."""

  config: ViTConfig
  num_classes: int

  @nn.compact
  def __call__(self, images: jax.Array) -> jax.Array:
    cfg = self.config
    p = cfg.patch_size
    x = nn.Conv(
        cfg.width, (p, p), strides=(p, p), padding="VALID", **self.dtypes, name="embedding"
    )(images)
    b, h, w, c = x.shape
    x = x.reshape(b, h * w, c)
    pos = self.param(
        "pos_embedding", nn.initializers.normal(stddev=c**-0.5), (1, h * w, c), self.param_dtype
    )
    cls = self.param("cls", nn.initializers.zeros, (1, 1, c), self.param_dtype)
    x = x + pos.astype(self.dtype)
    x = constrain(x, ACT_EMBED)
    cls = constrain(jnp.tile(cls.astype(self.dtype), (b, 1, 1)), ACT_EMBED)  # Split as x is.
    x = jnp.concatenate([cls, x], axis=1)
    x = Encoder(cfg, **self.dtypes, name="Transformer")(x)
    head = nn.Dense(self.num_classes, **self.dtypes, kernel_init=nn.initializers.zeros, name="head")
    return head(x[:, 0]).astype(jnp.float32)


def build(
    size: str = "tiny",
    *,
    num_classes: int = 10,
    dtype: Any = jnp.float32,
    param_dtype: Any = jnp.float32,
    **config_overrides,
) -> ViT:
  """Returns a ``ViT`` of preset ``size``; extra kwargs override config fields.

  ``dtype``: the compute dtype; ``param_dtype``: the params' (names like "bfloat16" too).

  Example:
    >>> build("small", num_classes=100, patch_size=4).config.patch_size
    4
  """
  config = vit_config(size, **config_overrides)
  return ViT(config, num_classes, dtype=dtype, param_dtype=param_dtype)
