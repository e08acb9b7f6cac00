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

from bv_sharding.errors import ShardingError

MAX_DEPTH = 500  # Levels a planned tree may nest: far beyond any model's or optimizer's.

# Last path components of norm scales and biases: small vectors that sharding ops never shard.
NORM_AND_BIAS = frozenset({"scale", "bias"})


def is_box(x) -> bool:
  """Whether ``x`` is a flax metadata box (``nn.Partitioned``, ``nn.LogicallyPartitioned``)."""
  return isinstance(x, nn.meta.AxisMetadata)


def leaf_name(path) -> str:
  """The ``/``-joined name of a ``jax.tree_util`` key path."""
  return jax.tree_util.keystr(path, simple=True, separator="/")


def flatten(tree):
  """``([(name, leaf), ...], treedef)``; boxes count as leaves, ``None`` as an empty node.

  Raises ``ShardingError`` for a tree nested deeper than ``MAX_DEPTH`` (:func:`check_depth`).
  """
  check_depth(tree)
  pairs, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_box)
  return [(leaf_name(path), leaf) for path, leaf in pairs], treedef


def check_depth(tree) -> None:
  """Raises ``ShardingError`` if ``tree`` nests more than ``MAX_DEPTH`` levels, walked without
  recursion: jax's own flattening recurses, and a ``RecursionError`` deep inside it can leave
  the process unable to flatten any tree afterwards.

  Example:
    >>> deep = 0
    >>> for _ in range(MAX_DEPTH + 1):
    ...   deep = [deep]
    >>> check_depth(deep)
    Traceback (most recent call last):
    ...
    bv_sharding.errors.ShardingError: the tree nests deeper than 500 levels ...
  """
  stack = [(tree, 0)]
  while stack:
    node, depth = stack.pop()
    if depth > MAX_DEPTH:
      raise ShardingError(
          f"the tree nests deeper than {MAX_DEPTH} levels (a chain of containers, at a "
          f"{type(node).__name__}); plan a flatter tree, e.g. a dict of arrays by name"
      )
    if node is None or is_box(node):
      continue
    try:
      children, _ = jax.tree_util.flatten_one_level(node)
    except ValueError:  # A leaf.
      continue
    stack.extend((child, depth + 1) for child in children)
