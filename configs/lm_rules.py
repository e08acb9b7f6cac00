"""configs/lm.py with every param placed by its logical axis names and one rule list.

  python -m trainers.train --config configs/lm_rules.py --workdir /tmp/lm_rules

The way users of logical axis names work: the Llama boxes each param with
``nn.with_logical_partitioning`` ("vocab", "embed", "heads", "mlp", "norm"; see
trainers/models/llama.py), the strategy is ``logical_partitioning()`` alone, and
``config.sharding_rules`` is a MaxText/T5X-style rule list (name -> mesh axis,
resolved exactly as ``nn.logical_to_mesh_axes`` resolves it; a name listed twice is
a fallback, an empty target means replicated). Over a data x model mesh this is
FSDP on "embed" over "data" and Megatron-style tensor parallelism on heads, mlp
and vocab over "model"; optimizer state follows its params. The same rules
constrain the activations (the "act_*" names).
"""

from configs import lm


def get_config(arg=None):
  """arg: as configs/lm.py."""
  config = lm.get_config(arg)
  config.mesh = (("data", -1), ("model", 2))
  config.sharding_strategy = ((".*", "logical_partitioning()"),)
  config.sharding_rules = (
      # Activations.
      ("act_batch", "data"),
      ("act_heads", "model"),
      ("act_mlp", "model"),
      ("act_vocab", "model"),
      # Params.
      ("vocab", "model"),
      ("heads", "model"),
      ("mlp", "model"),
      ("embed", "data"),
      ("norm", ()),
      ("layers", ()),
  )
  return config
