"""``configs/lm.py`` with blocked Shampoo: Adam grafting, roots every 10 steps.

python -m trainers.train --config configs/lm_shampoo.py --workdir /tmp/lm_shampoo
"""

from configs import lm


def get_config(arg=None):
  """The LM config with Shampoo; ``arg`` as in ``configs/lm.py``."""
  config = lm.get_config(arg)
  config.optax_name = "shampoo"
  config.optax = dict(graft_type="adam", update_preconditioners_freq=10)
  config.lr = 1e-3
  return config
