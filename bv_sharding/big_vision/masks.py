"""Masks of params named by regexes, in big_vision's convention: a regex ``fullmatch``es a
``/``-joined param name (big_vision's ``tree_flatten_with_names``: ``"encoderblock/mlp/kernel"``,
no ``params/`` prefix), and a leaf takes the first regex of its list that matches.

Example:
  >>> params = {"img": {"kernel": 0, "bias": 0}, "head": {"kernel": 0}}
  >>> first_match([".*/kernel"], "config.wd_mults", cover=False)(params)
  {'head': {'kernel': True}, 'img': {'bias': False, 'kernel': True}}
"""

from collections.abc import Callable, Sequence

import jax

from bv_sharding import names
from bv_sharding.errors import ConfigError
from bv_sharding.patterns import bounded_fullmatch, compiled_regex

__all__ = ["first_match"]


def first_match(patterns: Sequence[str], where: str, cover: bool, pick=None) -> Callable:
  """``tree -> bool tree``: per leaf, ``pick[i]`` for the first pattern ``i`` it fullmatches
  (``False`` for none); ``pick=None`` marks every matched leaf. Boxes count as leaves.

  Raises:
    ConfigError: a pattern starting with ``/``; when the mask is computed, with ``cover``, a
      leaf that no pattern matches.
  """
  for pattern in patterns:
    if pattern.startswith("/"):
      raise ConfigError(
          f"{where} regex {pattern!r} starts with '/', which no param name does; write "
          f"{pattern.lstrip('/')!r}"
      )
  compiled = [compiled_regex(p, where, ConfigError) for p in patterns]
  pick = [True] * len(compiled) if pick is None else list(pick)

  def mask(tree):
    named, treedef = names.flatten(tree)
    flags = []
    for name, _ in named:
      matches = (bounded_fullmatch(c, name, where, ConfigError) for c in compiled)
      first = next((i for i, hit in enumerate(matches) if hit), None)
      if first is None and cover:
        raise ConfigError(
            f"param {name!r} matches no regex of {where} {list(patterns)}; every param must be "
            "covered: add a '.*' entry, or (regex, None) to freeze it"
        )
      flags.append(first is not None and pick[first])
    return jax.tree.unflatten(treedef, flags)

  return mask
