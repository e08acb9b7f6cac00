"""Optimizer state in the form that does not depend on the mesh, and back.

Kron, Shampoo and SOAP can keep a pool's state where the pool runs (``resident_padding``:
:mod:`~bv_sharding.optimizers.holding`), in shapes that depend on the device count. A
checkpoint meant for another mesh, or for another optimizer's run, holds the state given
back to the params instead (:func:`canonical_state`): the state the same optimizer has
without ``resident_padding``, the same on any mesh. :func:`held_state` keeps it in the pools
of a layout again. Any other state passes through unchanged.

Example:
    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> from bv_sharding.optimizers import ParamLayout, scale_by_soap
    >>> layout = ParamLayout({"w": P("data")}, jax.sharding.AbstractMesh((4,), ("data",)))
    >>> params = {"w": jnp.ones((16, 8))}  # One 16 x 8 tile over 4 shards: pooled, turned
    >>> tx = scale_by_soap(block_size=16, layout=layout, resident_padding=4)
    >>> state = tx.init(params)
    >>> state.pools[0]["mu"].shape, state.per_param["w"].mu  # 4 slots, one of them a tile
    ((4, 8, 16), None)
    >>> canonical = canonical_state(state, params, layout)
    >>> canonical.per_param["w"].mu.shape, canonical.pools
    ((16, 8), ())
    >>> like = jax.eval_shape(tx.init, params)
    >>> [b.shape for b in held_state(canonical, like, params, layout).pools[0]["bases"]]
    [(4, 8, 8), (4, 16, 16)]
"""

import jax

from bv_sharding.optimizers.kron import given_back as kron_given_back
from bv_sharding.optimizers.kron import held as kron_held
from bv_sharding.optimizers.kron import holds
from bv_sharding.optimizers.layout import ParamLayout
from bv_sharding.optimizers.shampoo import ShampooState
from bv_sharding.optimizers.shampoo import given_back as shampoo_given_back
from bv_sharding.optimizers.shampoo import held as shampoo_held
from bv_sharding.optimizers.soap import SoapState
from bv_sharding.optimizers.soap import given_back as soap_given_back
from bv_sharding.optimizers.soap import held as soap_held


def _holder(x) -> bool:
  """Whether ``x`` is a state node that may hold pools: SOAP's, Shampoo's, or Kron's dict."""
  return isinstance(x, (SoapState, ShampooState)) or (
      isinstance(x, dict) and "Qs_preconditioners" in x
  )


def canonical_state(state, params, layout: ParamLayout):
  """``state`` (any optimizer state, e.g. a chain's) with every pool kept where it runs given
  back to its params. ``params``: the params (or their shapes); ``layout``: the layout the
  optimizer was built on."""

  def back(x):
    if isinstance(x, SoapState) and x.pools:
      return soap_given_back(x, params, layout)
    if isinstance(x, ShampooState) and x.pools:
      return shampoo_given_back(x, params, layout)
    return kron_given_back(x, params, layout) if holds(x) else x

  return jax.tree.map(back, state, is_leaf=_holder)


def held_state(state, like, params, layout: ParamLayout):
  """``state`` in :func:`canonical_state`'s form with its pools kept where they run as in
  ``like``: the state (or ``jax.eval_shape`` of the ``init``) of the same optimizer on
  ``layout``."""

  def hold(x, y):
    if isinstance(y, SoapState) and y.pools:
      return soap_held(x, params, layout, y.pools)
    if isinstance(y, ShampooState) and y.pools:
      return shampoo_held(x, params, layout, y.pools)
    return kron_held(x, params, layout, y["pools"]) if holds(y) else x

  return jax.tree.map(hold, state, like, is_leaf=_holder)
