"""``configs/lm.py`` with PSGD Kron (the registry's 256-blocks).

python -m trainers.train --config configs/lm_kron.py --workdir /tmp/lm_kron
"""

from configs import lm


def get_config(arg=None):
  """The LM config with Kron; ``arg`` as in ``configs/lm.py``."""
  config = lm.get_config(arg)
  config.optax_name = "kron"
  config.optax = dict(b1=0.9, preconditioner_lr=0.1)
  config.lr = 1e-3
  return config
