"""Byte-level Llama LM on stdlib text, FSDP over all devices.

  python -m trainers.train --config configs/lm.py --workdir /tmp/lm
  python -m trainers.train --config configs/lm.py:size=small --workdir /tmp/lm \
      --config.optax_name=kron          # the only change needed to switch optimizers
  python -m trainers.train --config configs/lm.py:size=1b --workdir /tmp/lm1b \
      --config.compute_dtype=bfloat16   # ~1B params (vocab 32000) on one 80 GiB accelerator
  python -m trainers.train --config configs/lm.py:size=1b --workdir /tmp/lm1b \
      --config.compute_dtype=bfloat16 --config.param_dtype=bfloat16 \
      --config.state_dtype=bfloat16 --config.grad_accum_steps=16   # one 16 GiB chip (TPU v5e)

The default (tiny) runs in about a minute on a 2-core CPU with 8 simulated devices;
``configs/lm.py:layers=1`` gives its model one layer instead of two.
"""

from configs.common import base_config, parse_arg
from trainers.input import sources


def get_config(arg=None):
  """The LM config; ``arg``: ``size=tiny|small|medium|1b`` (1b: seq_len 2048, batch 16) and
  ``layers=N`` (the model's layer count; 0, the default: the size's)."""
  arg = parse_arg(arg, size="tiny", layers=0)
  # seed, eval_batches, log_every, eval_every, mesh, rules, adamw, wd, clipping, checkpoints:
  config = base_config()

  # The Python standard library's source as a byte-level text corpus (first 4 MiB);
  # configs/lm_data.py trains on your own token files or text.
  config.input = sources.input_config(kind="text", train=sources.STDLIB_TEXT, max_tokens=4 * 2**20)
  config.seq_len = 128
  config.batch_size = 32

  config.model_name = "llama"
  config.model = dict(size=arg["size"], scan_layers=False, remat=False)
  if arg["layers"]:
    config.model.n_layers = arg["layers"]

  config.total_steps = 300

  # min_size_to_shard_mb=0: shard even the tiny model's leaves (the default is 1 MiB).
  config.sharding_strategy = ((".*", 'llm_fsdp(axis="data", min_size_to_shard_mb=0)'),)

  config.lr = 3e-3
  # big_vision's schedule keys: a multiplier of config.lr over config.total_steps.
  config.schedule = dict(decay_type="cosine", warmup_steps=10)
  # One 80-141 GiB accelerator: 32k tokens a step, layers rematerialised (a 16 GiB chip: above).
  if arg["size"] == "1b":
    config.seq_len, config.batch_size, config.lr = 2048, 16, 3e-4
    config.model.update(scan_layers=True, remat=True)
  return config
