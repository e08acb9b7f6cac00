"""The dtypes a config asks for: ``config.compute_dtype``, ``param_dtype`` and ``state_dtype``.

``compute_dtype`` is the models' activations and matmuls; ``param_dtype`` the stored
params (and so their gradients); ``state_dtype`` every floating-point optimizer state
array (``bv_sharding/optimizers/state_dtype.py``), None meaning the params' dtype.
Whatever they say, the models return float32 logits (the loss and its softmax reduce in
float32), attention's softmax and the norms' statistics run in float32, and the
optimizers update in float32.

Example:
  >>> from configs.common import base_config
  >>> config = base_config()
  >>> config.compute_dtype = "bfloat16"
  >>> of_config(config)
  Precision(compute='bfloat16', param='float32', state='float32')
"""

import dataclasses

from trainers.settings import schema

DTYPES = schema.DTYPES  # The names the dtype keys accept.


@dataclasses.dataclass(frozen=True)
class Precision:
  """The dtype names of a run: compute, stored params and optimizer state."""

  compute: str = "float32"
  param: str = "float32"
  state: str = "float32"


def of_config(config) -> Precision:
  """The config's :class:`Precision`; a missing key is float32, ``state_dtype`` None the params'."""
  config = schema.of(config)
  param = config.param_dtype or "float32"
  return Precision(
      compute=config.compute_dtype or "float32",
      param=param,
      state=config.state_dtype or param,
  )
