"""Leaf names: ``/``-joined key paths, the same whatever the root container is.

Dict keys (of any type, via ``str``), attribute and field names (NamedTuples,
dataclasses, flax ``TrainState``) and list indices all become path components,
so ``{"params": p}``, ``TrainState(params=p, ...)`` and ``NT(params=p)`` name the
leaves of ``p`` identically. Flax boxes (``nn.Partitioned``) are leaves.

Example:
  >>> import collections
  >>> import numpy as np
  >>> w = np.zeros((4, 8))
  >>> [name for name, _ in flatten({"params": {"dense": {"kernel": w}}, "opt": [w]})[0]]
  ['opt/0', 'params/dense/kernel']
  >>> State = collections.namedtuple("State", ["params"])
  >>> [name for name, _ in flatten(State(params={"dense": {"kernel": w}}))[0]]
  ['params/dense/kernel']
"""

import flax.linen as nn
import jax

# Last path components of norm scales and biases: small vectors that sharding ops never shard.
NORM_AND_BIAS = frozenset({"scale", "bias"})


def is_box(x) -> bool:
  """Whether ``x`` is a flax metadata box (``nn.Partitioned``, ``nn.LogicallyPartitioned``)."""
  return isinstance(x, nn.meta.AxisMetadata)


def leaf_name(path) -> str:
  """The ``/``-joined name of a ``jax.tree_util`` key path."""
  return jax.tree_util.keystr(path, simple=True, separator="/")


def flatten(tree):
  """``([(name, leaf), ...], treedef)``; boxes count as leaves, ``None`` as an empty node."""
  pairs, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_box)
  return [(leaf_name(path), leaf) for path, leaf in pairs], treedef
