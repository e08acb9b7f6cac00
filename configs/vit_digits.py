"""Tiny ViT on sklearn's 8x8 digits, FSDP over all devices.

python -m trainers.train --config configs/vit_digits.py --workdir /tmp/vit
"""

from configs.common import base_config, parse_arg
from trainers.input import sources


def get_config(arg=None):
  """The ViT config; ``arg``: ``size=tiny|small``."""
  arg = parse_arg(arg, size="tiny")
  # seed, eval_batches, log_every, eval_every, mesh, rules, adamw, wd, clipping, checkpoints:
  config = base_config()

  config.input = sources.input_config(kind="digits")  # configs/vit_images.py: your .npy images
  config.batch_size = 64

  config.model_name = "vit"
  config.model = dict(size=arg["size"], num_classes=10)

  config.total_steps = 200

  config.sharding_strategy = ((".*", 'fsdp(axis="data", min_size_to_shard_mb=0)'),)

  config.lr = 1e-3
  # big_vision's schedule keys: a multiplier of config.lr; the warmup a fraction of total_steps.
  config.schedule = dict(decay_type="cosine", warmup_percent=0.05)
  return config
