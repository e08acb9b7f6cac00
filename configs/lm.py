"""Byte-level Llama LM on stdlib text, FSDP over all devices.

  python -m trainers.train --config configs/lm.py --workdir /tmp/lm
  python -m trainers.train --config configs/lm.py:size=small --workdir /tmp/lm \
      --config.optax_name=kron          # the only change needed to switch optimizers

The default (tiny) runs in about a minute on a 2-core CPU with 8 simulated devices.
"""

import ml_collections
from ml_collections import config_dict

from configs.common import parse_arg


def get_config(arg=None):
  """arg: `size=tiny|small|medium`."""
  arg = parse_arg(arg, size="tiny")
  config = ml_collections.ConfigDict()
  config.seed = 0

  config.input = "text"
  config.seq_len = 128
  config.batch_size = 32
  config.eval_batches = 4  # Fixed held-out batches, the same at every eval.

  config.model_name = "llama"
  config.model = dict(size=arg["size"], scan_layers=False, remat=False)

  config.total_steps = 300
  config.log_every = 20
  config.eval_every = 100

  config.mesh = (("data", -1),)
  config.dcn_mesh = ()  # Across TPU slices, e.g. (("data", 2),); () = one slice.
  # min_size_to_shard_mb=0: shard even the tiny model's leaves (the default is 1 MiB).
  config.sharding_strategy = ((".*", 'llm_fsdp(axis="data", min_size_to_shard_mb=0)'),)
  config.sharding_rules = (("act_batch", "data"),)
  config.data_axes = ()  # () = the mesh axes the "act_batch" rule maps to.
  # Refuse to start when more of the state's bytes is unsharded (None: no gate).
  config.max_unsharded_fraction = config_dict.placeholder(float)

  config.optax_name = "adamw"
  config.optax = dict()
  config.lr = 3e-3
  config.wd = 1e-4
  config.schedule = dict(warmup_steps=10, decay="cosine", end_value=3e-4)  # total_steps added
  config.grad_clip_norm = 1.0
  return config
