"""How an optimizer-state leaf relates to the param it belongs to.

State leaves are tied to params through tree paths (the param's path, without
the leading ``params``, appears inside the state leaf's path whatever wraps it)
and through shapes, never through optimizer names. The relation decides the
state leaf's spec:

* same shape (Adam moments, momentum, EMA, ...): the param's spec;
* a list entry under the param, one per param dim (PSGD Kron ``Q_i``): the
  factor of dim ``i``: ``(d_i, d_i)``, ``(d_i,)`` or scanned ``(L, d_i, d_i)``;
  the param's axis for dim ``i`` goes on :data:`FACTOR_DIM` (columns) of the factor;
* dims kept in order (Adafactor's row/column statistics): each kept dim keeps
  its axis when the shapes say which param dim it is (a square param's row and column
  statistics look alike: those dims stay unsharded);
* a block stack ``(n, b, b)`` whose ``n`` the param's shard count divides
  (shard-local blocks of a Kron or Shampoo preconditioner, cut shard by shard): dim 0 over
  all the param's axes, in the order :func:`stack_axes` gives, so every device holds
  the factors of the blocks of its own shard; a never-sharded param's stack goes over
  every mesh axis (its blocks are dealt to the devices, one piece each);
* nothing in common: the size-based fallback.

A statistic over some of the param's dims (dims kept, a diagonal factor ``(d_i,)``)
``broadcasts``: the update multiplies it, expanded, with the gradient, so under Explicit
axes it may carry only the param's axes on the dims it keeps. Any other axis would either
sit on two dims of the product (``f32[16@data,8], f32[1,8@data]``: an illegal sharding) or
change the update's sharding, so such a leaf goes to the fallback over Auto axes only
(:mod:`bv_sharding.planning`): under Auto axes the compiler reshards it.

Example:
  >>> relate((512,), (), "params/w", (512, 1024), ("data", None)).spec
  ('data',)
  >>> f = relate((1024, 1024), ("1",), "params/w", (512, 1024), (None, "data"))
  >>> f.how, f.spec
  ('factor of dim 1', (None, 'data'))
  >>> relate((64, 128, 128), ("0",), "params/w", (512, 1024), ("data", "model")).spec
  (('data', 'model'), None, None)
"""

import dataclasses
import functools
import itertools

from bv_sharding.specs import Spec, axes_of

# Which dim of a square Kron factor (d_i, d_i) takes param dim i's axis: dim 1
# (columns). Measured on one psgd-jax Kron update of a small Llama (8 devices): 1.8x fewer
# wire bytes per device with columns (1268 MB) than with rows (2253 MB).
# `preconditioner(dim=0)` overrides it.
FACTOR_DIM = 1


@dataclasses.dataclass(frozen=True)
class Follow:
  """A state leaf's param (name, shape, spec), how they relate, and the spec carried over.

  ``factor`` is ``(param_dim, n_leading)`` for a preconditioner factor, else ``None``;
  ``spec`` is ``None`` when nothing can be carried (the fallback); ``broadcasts`` marks a
  statistic over some of the param's dims, which takes no axis but those carried (module
  docstring).
  """

  param: str
  param_shape: tuple[int, ...]
  param_spec: Spec
  how: str
  spec: Spec | None
  factor: tuple[int, int] | None = None
  broadcasts: bool = False


def find_param(components: tuple[str, ...], params: dict[tuple[str, ...], str]):
  """The longest param path (key of ``params``) inside ``components``, and the components after it."""
  best = None
  for start in range(len(components)):
    for stop in range(len(components), start, -1):
      key = components[start:stop]
      if key in params and (best is None or len(key) > len(best[0])):
        best = (key, components[stop:])
        break
  return (params[best[0]], best[1]) if best else (None, ())


def relate(
    shape,
    rest,
    param: str,
    param_shape,
    param_spec,
    factor_dim: int = FACTOR_DIM,
    mesh_sizes: dict[str, int] | None = None,
) -> Follow:
  """How a state leaf of ``shape``, found at ``rest`` below ``param``, follows it.

  ``mesh_sizes``: the mesh's axis sizes, whose axes split a never-sharded param's block
  stacks (see :func:`stack_axes`).
  """
  shape, param_shape, param_spec = tuple(shape), tuple(param_shape), tuple(param_spec)
  follow = functools.partial(Follow, param, param_shape, param_spec)
  index = _list_index(rest)
  factor = None if index is None else factor_of(shape, param_shape, index)
  if factor is not None:
    dim, lead = factor
    spec = factor_spec(shape, param_spec, dim, lead, factor_dim)
    return follow(f"factor of dim {dim}", spec, factor, broadcasts=len(shape) == lead + 1)
  if shape == param_shape:
    return follow("same shape", param_spec)
  kept = kept_spec(shape, param_shape, param_spec)
  if kept is not None:
    return follow("dims carried", kept, broadcasts=True)
  axes = stack_axes(param_spec, mesh_sizes)
  if axes and _is_block_stack(shape):
    return follow("block stack", (axes,) + (None,) * (len(shape) - 1))
  return follow("fallback", None)


def stack_axes(param_spec, mesh_sizes: dict[str, int] | None = None) -> tuple[str, ...]:
  """The axes that split a param's block stacks: its spec's axes in dim order.

  A block stack built shard by shard (shard-major over the param's dims) is split
  evenly by these axes, each device getting the blocks of its own shard. A param no
  axis splits has its blocks dealt to every device instead: the axes of ``mesh_sizes``
  (axis name -> size) of size > 1, in mesh order.

  Example:
    >>> stack_axes((None, "data", ("model", "pipe")))
    ('data', 'model', 'pipe')
    >>> stack_axes((None,), {"data": 4, "pipe": 1, "model": 2})
    ('data', 'model')
  """
  own = tuple(a for entry in param_spec for a in axes_of(entry))
  return own or tuple(a for a, n in (mesh_sizes or {}).items() if n > 1)


def _is_block_stack(shape) -> bool:
  """``(n, b, b)``: a stack of square factors (2-D leaves, e.g. one (b, b) statistic, are not)."""
  return len(shape) == 3 and shape[1] == shape[2]


def factor_of(shape, param_shape, index: int) -> tuple[int, int] | None:
  """``(param_dim, n_leading)`` when a list entry at ``index`` is a preconditioner factor.

  Entry ``i`` is the factor of dim ``i`` (``(d_i, d_i)`` or diagonal ``(d_i,)``), or
  of dim ``i + 1`` behind a leading scanned-layer axis (``(L, d, d)`` or ``(L, d)``).
  """
  for dim, layer_axis in ((index, ()), (index + 1, param_shape[:1])):
    if dim < len(param_shape):
      d = param_shape[dim]
      if shape in (layer_axis + (d, d), layer_axis + (d,)):
        return dim, len(layer_axis)
  return None


def factor_spec(shape, param_spec, factor: int, lead: int, factor_dim: int) -> Spec:
  """A factor's spec: param dim ``factor``'s axis on ``factor_dim`` of its square (or diagonal)
  part; a leading layer axis keeps the param's first-dim axis."""
  spec = [None] * len(shape)
  if lead:
    spec[0] = param_spec[0]
  spec[factor_dim_index(len(shape), lead, factor_dim)] = param_spec[factor]
  return tuple(spec)


def factor_dim_index(ndim: int, lead: int, factor_dim: int) -> int:
  """Index of dim ``factor_dim`` of a factor's square (or diagonal) part, behind ``lead`` layer dims.

  Example:
    >>> factor_dim_index(3, 1, 1), factor_dim_index(2, 0, 0), factor_dim_index(1, 0, 1)
    (2, 0, 0)
  """
  return lead + factor_dim % (ndim - lead)


def _list_index(rest: tuple[str, ...]) -> int | None:
  digits = [int(c) for c in rest if c.isdigit()]
  return digits[-1] if digits else None


def kept_spec(shape, param_shape, param_spec) -> Spec | None:
  """The spec of a statistic of ``shape`` that keeps some of the param's dims in order, or ``None``.

  Each dim takes the axis of the param dim it keeps. Where the shapes fit several choices
  of kept dims (a square param's row and column statistics) and those disagree on a dim's
  axis, the dim stays unsharded: the axis of the wrong choice would sit, in the update's
  product, on a dim the param shards with another axis (or the same axis twice).

  Example:
    >>> kept_spec((512,), (512, 1024), ("data", None))  # rows: dim 0 kept
    ('data',)
    >>> kept_spec((128,), (128, 128), ("data", None))  # rows or columns: unsharded
    (None,)
  """
  if len(shape) >= len(param_shape):
    return None
  fits = [
      dims
      for dims in itertools.combinations(range(len(param_shape)), len(shape))
      if all(param_shape[d] == s for d, s in zip(dims, shape))
  ]
  if not fits:
    return None
  choices = [{param_spec[dims[j]] for dims in fits} for j in range(len(shape))]
  return tuple(axes.pop() if len(axes) == 1 else None for axes in choices)
