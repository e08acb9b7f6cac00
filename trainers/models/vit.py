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
"act_embed").

Example:
  >>> model = build("tiny", num_classes=10)
  >>> images = jnp.zeros((2, 8, 8, 1))
  >>> params = model.init(jax.random.key(0), images)["params"]
  >>> model.apply({"params": params}, images).shape
  (2, 10)
"""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from trainers.models import _presets
from trainers.models.axes import ACT_EMBED


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


class MlpBlock(nn.Module):
  """Dense -> GELU -> Dense, back to the input width."""

  mlp_dim: int

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    dense = lambda n: nn.Dense(
        n,
        kernel_init=nn.initializers.xavier_uniform(),
        bias_init=nn.initializers.normal(stddev=1e-6),
    )
    h = nn.gelu(dense(self.mlp_dim)(x))  # Dense_0
    return dense(x.shape[-1])(h)  # Dense_1


class Encoder1DBlock(nn.Module):
  """Pre-LayerNorm self-attention + MLP residual block."""

  mlp_dim: int
  num_heads: int

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    y = nn.LayerNorm()(x)
    x = x + nn.MultiHeadDotProductAttention(
        num_heads=self.num_heads, kernel_init=nn.initializers.xavier_uniform()
    )(y, y)
    x = x + MlpBlock(self.mlp_dim)(nn.LayerNorm()(x))
    return nn.with_logical_constraint(x, ACT_EMBED)


class Encoder(nn.Module):
  """``depth`` blocks named ``encoderblock_{i}``, then ``encoder_norm``."""

  config: ViTConfig

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    cfg = self.config
    for i in range(cfg.depth):
      x = Encoder1DBlock(cfg.mlp_dim, cfg.num_heads, name=f"encoderblock_{i}")(x)
    return nn.LayerNorm(name="encoder_norm")(x)


class ViT(nn.Module):
  """Images (B, H, W, C) -> logits (B, num_classes), pooled on the cls token."""

  config: ViTConfig
  num_classes: int

  @nn.compact
  def __call__(self, images: jax.Array) -> jax.Array:
    cfg = self.config
    p = cfg.patch_size
    x = nn.Conv(cfg.width, (p, p), strides=(p, p), padding="VALID", name="embedding")(images)
    b, h, w, c = x.shape
    x = x.reshape(b, h * w, c)
    x = x + self.param("pos_embedding", nn.initializers.normal(stddev=c**-0.5), (1, h * w, c))
    cls = self.param("cls", nn.initializers.zeros, (1, 1, c))
    x = jnp.concatenate([jnp.tile(cls, (b, 1, 1)), x], axis=1)
    x = nn.with_logical_constraint(x, ACT_EMBED)
    x = Encoder(cfg, name="Transformer")(x)
    return nn.Dense(self.num_classes, kernel_init=nn.initializers.zeros, name="head")(x[:, 0])


def build(size: str = "tiny", *, num_classes: int = 10, **config_overrides) -> ViT:
  """Returns a ``ViT`` of preset ``size``; extra kwargs override config fields.

  Example:
    >>> build("small", num_classes=100, patch_size=4).config.patch_size
    4
  """
  return ViT(vit_config(size, **config_overrides), num_classes=num_classes)
