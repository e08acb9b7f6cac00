"""A drop-in for big_vision's sharding and optax modules. Its ``train.py`` runs with::

    import bv_sharding.big_vision.sharding as bv_sharding
    import bv_sharding.big_vision.optax as bv_optax

:mod:`~bv_sharding.big_vision.sharding` gives big_vision's ``infer_sharding`` (the
shardings tree) from the library's plan; :mod:`~bv_sharding.big_vision.optax` gives
``make``, ``get_count`` and ``replace_frozen`` with big_vision's chain, its schedules
(:mod:`~bv_sharding.big_vision.schedules`) and its optimizer names
(:mod:`~bv_sharding.big_vision.transformations`). Mistakes raise :class:`ConfigError`.

Example:
  >>> from bv_sharding.big_vision import optax as bv_optax
  >>> bv_optax.replace_frozen({"decay_type": "cosine"}, {"w": 1.0}, 0.0)  # nothing frozen
  {'w': 1.0}
"""

from bv_sharding.big_vision import optax, schedules, sharding, transformations
from bv_sharding.errors import ConfigError

__all__ = ["ConfigError", "optax", "schedules", "sharding", "transformations"]
