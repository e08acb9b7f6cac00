"""``configs/lm.py`` on a 2-D mesh: Megatron tensor parallelism over "model", FSDP over "data".

python -m trainers.train --config configs/lm_tp_fsdp.py --workdir /tmp/lm_tp
"""

from configs import lm


def get_config(arg=None):
  """The LM config on a data x model mesh; ``arg`` as in ``configs/lm.py``."""
  config = lm.get_config(arg)
  config.mesh = (("data", -1), ("model", 2))
  config.sharding_strategy = (
      (".*", 'tensor_parallel(axis="model")|fsdp(axis="data", min_size_to_shard_mb=0)'),
  )
  config.sharding_rules = (("act_batch", "data"), ("act_heads", "model"), ("act_mlp", "model"))
  return config
