"""Byte-level Llama LM on stdlib text, FSDP over all devices.

  python -m trainers.train --config configs/lm.py --workdir /tmp/lm
  python -m trainers.train --config configs/lm.py:size=small --workdir /tmp/lm \
      --config.optax_name=kron          # the only change needed to switch optimizers

The default (tiny) runs in about a minute on a 2-core CPU with 8 simulated devices.
"""

import ml_collections

from configs.common import parse_arg
from trainers import sources


def get_config(arg=None):
  """arg: `size=tiny|small|medium`."""
  arg = parse_arg(arg, size="tiny")
  config = ml_collections.ConfigDict()
  config.seed = 0

  # The Python standard library's source as a byte-level text corpus (first 4 MiB);
  # configs/lm_data.py trains on your own token files or text.
  config.input = sources.input_config(kind="text", train=sources.STDLIB_TEXT, max_tokens=4 * 2**20)
  config.seq_len = 128
  config.batch_size = 32
  config.eval_batches = 4  # Fixed held-out batches, the same at every eval.

  config.model_name = "llama"
  config.model = dict(size=arg["size"], scan_layers=False, remat=False)

  config.total_steps = 300
  config.log_every = 20
  config.eval_every = 100

  config.mesh = (("data", -1),)
  # min_size_to_shard_mb=0: shard even the tiny model's leaves (the default is 1 MiB).
  config.sharding_strategy = ((".*", 'llm_fsdp(axis="data", min_size_to_shard_mb=0)'),)
  config.sharding_rules = (("act_batch", "data"),)
  config.data_axes = ()  # () = the mesh axes the "act_batch" rule maps to.

  config.optax_name = "adamw"
  config.optax = dict()
  config.lr = 3e-3
  config.wd = 1e-4
  # big_vision's schedule keys: a multiplier of config.lr over config.total_steps.
  config.schedule = dict(decay_type="cosine", warmup_steps=10)
  config.grad_clip_norm = 1.0  # None: no clipping.
  config.on_nonfinite = "stop"  # A NaN/inf loss ends the run; "skip": skip that update.
  return config
