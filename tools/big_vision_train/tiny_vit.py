"""A small ViT config for big_vision's own ``train.py``: its ``vit_i1k`` config, shrunk.

Read by big_vision (``--config tiny_vit.py:OPTAX_NAME[,KEY=VALUE...]``): the argument names
``config.optax_name`` and the ``config.optax`` arguments, e.g.
``tiny_vit.py:bv_sharding.scale_by_shampoo,block_size=32,graft_type='adam'``; the one key
``scan=True`` is not the optimizer's: it scans the encoder's blocks (big_vision's
``config.model.scan``) and names their stacks in ``config.scanned_layers``. The data's
``.jsonl`` (``make_data.py``) is set with ``--config.input.data.fname``; ``run.sh`` does both.

A ViT of width 64, 2 blocks, 4 heads, patch 8 on 32x32 images of 8 classes, batch 32,
``softmax_xent``, 5 warmup steps then cosine, ``wd=1e-4``, clipping at 1, fsdp over all
devices (``config.mesh=[("data", -1)]``), a checkpoint every 20 steps, no evals. Needs only
``ml_collections``, so it loads without big_vision on the path too.
"""

import ast

import ml_collections as mlc


def _value(text: str):
  """``text`` as a Python literal where it is one (``32``, ``'adam'``, ``0.9``), else the string."""
  try:
    return ast.literal_eval(text)
  except (ValueError, SyntaxError):
    return text


def get_config(arg: str | None = None) -> mlc.ConfigDict:
  """The config; ``arg`` is ``OPTAX_NAME[,KEY=VALUE...]`` (default ``scale_by_adam``)."""
  name, *pairs = (arg or "scale_by_adam").split(",")
  optax = {k: _value(v) for k, v in (pair.split("=", 1) for pair in pairs)}
  scan = optax.pop("scan", False)

  config = mlc.ConfigDict()
  config.seed = 0
  config.total_steps = 20
  config.num_classes = 8
  config.loss = "softmax_xent"

  config.input = dict(
      data=dict(name="bv:jsonl", fname="", fopen_keys=["image"]),
      batch_size=32,
      shuffle_buffer_size=512,
      pp=(
          "decode|resize(32)|value_range(-1, 1)"
          '|onehot(8, key="label", key_result="labels")|keep("image", "labels")'
      ),
      prefetch=2,
  )
  config.prefetch_to_device = 1
  config.log_training_steps = 5
  config.ckpt_steps = 20

  config.model_name = "vit"
  config.model = dict(
      variant="mu/8",
      width=64,
      depth=2,
      mlp_dim=256,
      num_heads=4,
      rep_size=True,
      pool_type="tok",
      scan=scan,
  )
  if scan:  # Each layer of the scanned blocks is its own matrix to Kron, Shampoo and SOAP.
    config.scanned_layers = "Transformer/encoderblock/.*"

  config.optax_name = name
  config.optax = optax
  config.grad_clip_norm = 1.0
  config.lr = 0.003
  config.wd = 1e-4
  config.schedule = dict(warmup_steps=5, decay_type="cosine")

  config.mesh = [("data", -1)]
  config.sharding_strategy = [(".*", 'fsdp(axis="data", min_size_to_shard_mb=0)')]
  config.sharding_rules = [("act_batch", "data")]

  config.evals = {}
  return config
