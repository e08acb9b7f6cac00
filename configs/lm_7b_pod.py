"""Llama 7B on a 256-device pod: FSDP over "data" (64) x tensor parallelism over "model" (4).

For planning tools, not for running here: ``config.num_devices`` (256) is the pod
size to plan for with ``bvs.make_abstract_mesh(config.mesh, config.num_devices)``,
which allocates nothing (``python -m trainers.plan --config configs/lm_7b_pod.py``).
``trainers/train.py`` ignores ``num_devices`` and uses the devices it has.

Example:
  >>> import bv_sharding as bvs
  >>> from trainers import build
  >>> config = get_config()
  >>> run = build.build(config, bvs.make_abstract_mesh(config.mesh, config.num_devices))
  >>> dict(run.mesh.shape), round(run.plan.bytes_per_device / (run.plan.total_bytes / 256), 3)
  ({'data': 64, 'model': 4}, 1.01)
"""

from configs import lm


def get_config(arg=None):
  """The 7B pod config; ``arg`` is unused (the size is 7b)."""
  del arg
  config = lm.get_config()
  config.num_devices = 256  # Devices to plan for; see the docstring.
  config.model = dict(size="7b", scan_layers=True, remat=True)
  config.seq_len = 4096
  config.batch_size = 256
  config.mesh = (("data", -1), ("model", 4))
  config.sharding_strategy = ((".*", 'tensor_parallel(axis="model")|llm_fsdp(axis="data")'),)
  config.max_unsharded_fraction = 0.02  # Refuse plans that leave more than 2% unsharded.
  config.sharding_rules = (
      ("act_batch", "data"),
      ("act_heads", "model"),
      ("act_mlp", "model"),
      ("act_vocab", "model"),
  )
  config.total_steps = 100_000
  config.log_every = 100
  config.eval_every = 2_000
  config.lr = 3e-4
  config.schedule = dict(decay_type="cosine", warmup_steps=2_000)
  return config
