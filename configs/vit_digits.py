"""Tiny ViT on sklearn's 8x8 digits, FSDP over all devices.

python -m trainers.train --config configs/vit_digits.py --workdir /tmp/vit
"""

import ml_collections

from configs.common import parse_arg


def get_config(arg=None):
  """arg: `size=tiny|small`."""
  arg = parse_arg(arg, size="tiny")
  config = ml_collections.ConfigDict()
  config.seed = 0

  config.input = "digits"
  config.batch_size = 64
  config.eval_batches = 4  # Fixed held-out batches, the same at every eval.

  config.model_name = "vit"
  config.model = dict(size=arg["size"], num_classes=10)

  config.total_steps = 200
  config.log_every = 20
  config.eval_every = 100

  config.mesh = (("data", -1),)
  config.sharding_strategy = ((".*", 'fsdp(axis="data", min_size_to_shard_mb=0)'),)
  config.sharding_rules = (("act_batch", "data"),)
  config.data_axes = ()  # () = the mesh axes the "act_batch" rule maps to.

  config.optax_name = "adamw"
  config.optax = dict()
  config.lr = 1e-3
  config.wd = 1e-4
  config.schedule = dict(decay_type="cosine", warmup_percent=0.05)  # big_vision's keys
  config.grad_clip_norm = 1.0
  return config
