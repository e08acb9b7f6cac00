"""Checksums of a train state's arrays: saved with each checkpoint, checked when it is read.

A leaf's checksum is a sum over its elements, wrapping at 2**32, of a term that depends on the
element's bit pattern and on its position ``i`` in the array (row-major; 64-bit elements count
as two 32-bit words). Format 2 (``FORMAT``, what a save writes): the term is murmur3's
finalizer (a bijection of uint32) of ``bits ^ (i * 0x9E3779B9)``, so any one changed element
changes the sum, and swapped elements or blocks, or several changes, leave it unchanged with a
chance of about 2**-32. Format 1 (checkpoints saved before it, read and checked as they were):
``bits * (2 i + 1)``; any one changed element changes it too, but two elements ``i``, ``j``
swapped cancel when ``(a - b) (i - j)`` is a multiple of 2**31 (``x`` and ``-x``; blocks at a
power-of-two distance). Positions wrap at 2**32 elements.

A checkpoint's meta records the format (``"sums_format"``) beside the sums (``"sums"``). One
that records it must hold the sum of every array read: sums removed from it are damage, as
sums that differ are (:func:`damage`). A meta with neither was saved before checksums: nothing
can be checked (:func:`recorded` is None).

All of a state's sums are one jitted program on the devices that hold the arrays: each device
sums the elements of its own shards (positions in the whole array), the replicas of a shard
beyond the first add nothing, and one all-reduce adds the devices' partial sums of every leaf
together (a sum of integers does not depend on the order it is taken in); arrays of another
layout (unevenly sharded, not on one mesh) are summed by XLA's own partitioning. A save reads
and writes nothing more; a restore computes the sums again on the arrays it read, in the dtype
they were saved in. A save dispatches the program in the loop (:func:`start`) and fetches the
sums on its own thread.

Example:
  >>> import jax.numpy as jnp
  >>> tree = {"w": jnp.arange(6, dtype=jnp.float32).reshape(2, 3), "n": jnp.int32(7)}
  >>> sums = of(tree)
  >>> sums == of({"w": tree["w"].at[1, 2].set(5.5), "n": tree["n"]}), sorted(sums)
  (False, ['n', 'w'])
  >>> sums == of({"w": tree["w"][:, ::-1], "n": tree["n"]})  # Elements swapped.
  False
  >>> mismatch(sums, of(tree)) is None, mismatch(sums, {**sums, "w": 1})
  (True, 'w')
  >>> of({"v": jnp.arange(6)}, format=1)  # Format 1: 0 * 1 + 1 * 3 + 2 * 5 + ... + 5 * 11.
  {'v': 125}
"""

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

FORMAT = 2  # The format a save writes (meta's "sums_format"; a meta without one: 1).
SUMS, SUMS_FORMAT = "sums", "sums_format"  # The meta's keys: the sums, their format.
_GOLDEN = 0x9E3779B9  # An odd constant: position i's key is i * _GOLDEN (mod 2**32).


def of(tree, format: int = FORMAT) -> dict[str, int]:
  """``{leaf name: checksum}`` of ``tree``'s arrays (names as ``jax.tree_util.keystr`` with
  "/") in checksum ``format`` (1 or 2); waits for the sums, not for anything else."""
  return start(tree, format)()


def start(tree, format: int = FORMAT) -> Callable[[], dict[str, int]]:
  """:func:`of`, its programs dispatched now, its sums fetched when the function it returns is
  called (on another thread: a save's, while the loop goes on; ``tree`` may be donated in
  between, as jax runs a program reading an array before one that donates it)."""
  if format not in _TERMS:
    raise ValueError(f"checksum format {format} is not one of {sorted(_TERMS)}")
  flat, _ = jax.tree_util.tree_flatten_with_path(tree)
  named = [(name(path), x) for path, x in flat if isinstance(x, jax.Array)]
  parts = _sums([x for _, x in named], format)

  def fetch() -> dict[str, int]:
    sums = [0] * len(named)
    for (indices, _), got in zip(parts, jax.device_get([vector for _, vector in parts])):
      for i, s in zip(indices, got):
        sums[i] = int(s)
    return {leaf: s for (leaf, _), s in zip(named, sums)}

  return fetch


def mismatch(saved: dict[str, int], read: dict[str, int]) -> str | None:
  """The first leaf of ``read`` whose checksum is not the ``saved`` one (None: all agree; a
  leaf ``saved`` lacks is not checked here: :func:`damage` says when it must be there)."""
  return next((leaf for leaf, s in read.items() if leaf in saved and saved[leaf] != s), None)


def recorded(meta: dict) -> int | None:
  """The checksum format of a checkpoint's ``meta``: its "sums_format" (every save writes it);
  1 for sums without one (saved before format 2); None with neither (saved before checksums).

  Example:
    >>> recorded({"sums": {"w": 7}, "sums_format": 2}), recorded({"sums": {"w": 7}})
    (2, 1)
    >>> recorded({"sums_format": 2}), recorded({"step": 8}) is None
    (2, True)
  """
  if SUMS_FORMAT in meta:
    return meta[SUMS_FORMAT]
  return 1 if meta.get(SUMS) else None


def damage(meta: dict, read: dict[str, int]) -> str | None:
  """What is wrong with the sums ``read`` (:func:`of` the arrays read, in the format of
  :func:`recorded`) against the sums ``meta`` saved, None if nothing: a leaf without a saved
  sum in a meta that records its format (a save writes every array's), or a leaf whose sum
  differs (:func:`mismatch`).

  Example:
    >>> damage({"sums": {"w": 7}, "sums_format": 2}, {"w": 7}) is None
    True
    >>> damage({"sums": {"w": 7}, "sums_format": 2}, {"w": 8})
    'w does not match the checksum saved with it (its data files were changed after the save)'
    >>> damage({"sums_format": 2}, {"w": 7})
    'its meta records checksum format 2 but no checksum of w (its meta was changed after the save)'
  """
  sums = meta.get(SUMS) or {}
  if SUMS_FORMAT in meta:
    missing = next((leaf for leaf in read if leaf not in sums), None)
    if missing is not None:
      return (
          f"its meta records checksum format {meta[SUMS_FORMAT]} but no checksum of {missing} "
          "(its meta was changed after the save)"
      )
  leaf = mismatch(sums, read)
  if leaf is None:
    return None
  return (
      f"{leaf} does not match the checksum saved with it (its data files were changed after the "
      "save)"
  )


def name(path) -> str:
  """A leaf's name: its key path joined by "/"."""
  return jax.tree_util.keystr(path, simple=True, separator="/")


def _sums(arrays: list, format: int) -> list[tuple[list[int], jax.Array]]:
  """The arrays' checksums, dispatched: ``(indices in arrays, uint32 vector of their sums)`` for
  the arrays of each mesh (one program each), and for the others on the same devices."""
  groups = {}  # mesh, else the devices: the arrays one program takes.
  for i, x in enumerate(arrays):
    devices = tuple(sorted(d.id for d in x.sharding.device_set))
    groups.setdefault(x.sharding.mesh if _even(x) else devices, []).append(i)
  parts = []
  for mesh, indices in groups.items():
    xs = [arrays[i] for i in indices]
    if isinstance(mesh, tuple):
      parts.append((indices, _partitioned(format)(xs)))
    else:
      program = _local_program(mesh, tuple(x.sharding.spec for x in xs), format)
      parts.append((indices, program(xs)))
  return parts


def _even(x: jax.Array) -> bool:
  """Whether ``x`` is laid out on a mesh with every dimension divided evenly among its shards:
  what a per-device sum over the shards needs."""
  sharding = x.sharding
  if not isinstance(sharding, NamedSharding) or not isinstance(sharding.mesh, jax.sharding.Mesh):
    return False
  return all(n % math.prod(sharding.mesh.shape[a] for a in axes) == 0 for n, axes in _dims(x))


def _dims(x: jax.Array) -> list[tuple[int, tuple[str, ...]]]:
  """``(size, mesh axes it is split over)`` for each dimension of ``x``."""
  spec = tuple(x.sharding.spec) + (None,) * (x.ndim - len(x.sharding.spec))
  axes = lambda entry: () if entry is None else (entry,) if isinstance(entry, str) else entry
  return [(n, tuple(axes(entry))) for n, entry in zip(x.shape, spec)]


@functools.cache
def _local_program(mesh, specs: tuple, format: int):
  """The jitted program summing arrays laid out as ``specs`` on ``mesh``: each device its own
  shards, one all-reduce of the partial sums (a uint32 vector, one element per array)."""

  def partial_sums(*blocks):
    parts = [_block_sum(b, spec, mesh, format) for b, spec in zip(blocks, specs)]
    return jax.lax.psum(jnp.stack(parts), tuple(mesh.axis_names))

  summed = jax.shard_map(partial_sums, mesh=mesh, in_specs=specs, out_specs=P(), check_vma=False)
  return jax.jit(lambda arrays: summed(*arrays))


def _block_sum(block: jax.Array, spec, mesh, format: int) -> jax.Array:
  """This device's part of a checksum: the terms of the elements of its shard ``block`` of an
  array split as ``spec`` over ``mesh``; zero where the shard is a replica held first by another
  device. ``mesh`` None: ``block`` is the whole array."""
  words = _words(block)
  spec = tuple(spec) + (None,) * (words.ndim - len(spec))
  position, stride, split = jnp.uint32(0), 1, set()
  for d in reversed(range(words.ndim)):
    axes = () if spec[d] is None else (spec[d],) if isinstance(spec[d], str) else spec[d]
    shard = jnp.uint32(0)
    for axis in axes:  # The shard's index along d: row-major over its axes.
      shard = shard * jnp.uint32(mesh.shape[axis]) + jax.lax.axis_index(axis).astype(jnp.uint32)
    split.update(axes)
    start = shard * jnp.uint32(words.shape[d])
    along = jax.lax.broadcasted_iota(jnp.uint32, words.shape, d) + start
    position = position + along * jnp.uint32(stride % 2**32)
    stride *= words.shape[d] * math.prod(mesh.shape[a] for a in axes)
  first = jnp.bool_(True)
  for axis in mesh.axis_names if mesh else ():
    if axis not in split:  # A replica along this axis: counted by the device at index 0.
      first = first & (jax.lax.axis_index(axis) == 0)
  total = jnp.sum(_TERMS[format](words, position), dtype=jnp.uint32)
  return jnp.where(first, total, jnp.uint32(0))


@functools.cache
def _partitioned(format: int):
  """The jitted program summing arrays of any layout, each as one block (XLA partitions it)."""
  return jax.jit(lambda arrays: jnp.stack([_block_sum(x, (), None, format) for x in arrays]))


def _linear(words: jax.Array, position: jax.Array) -> jax.Array:
  """Format 1's term: ``bits * (2 i + 1)``."""
  return words * (position * jnp.uint32(2) + jnp.uint32(1))


def _mixed(words: jax.Array, position: jax.Array) -> jax.Array:
  """Format 2's term: murmur3's 32-bit finalizer of ``bits ^ (i * _GOLDEN)``."""
  x = words ^ (position * jnp.uint32(_GOLDEN))
  x = (x ^ (x >> 16)) * jnp.uint32(0x85EBCA6B)
  x = (x ^ (x >> 13)) * jnp.uint32(0xC2B2AE35)
  return x ^ (x >> 16)


_TERMS = {1: _linear, 2: _mixed}


def _words(x: jax.Array) -> jax.Array:
  """``x``'s bit patterns as uint32 (64-bit elements as two words each, a last axis of 2)."""
  if x.dtype == jnp.bool_:
    return x.astype(jnp.uint32)
  width = np.dtype(x.dtype).itemsize
  unsigned = _UNSIGNED[min(width, 4)]
  if width == 8:
    return jax.lax.bitcast_convert_type(x, jnp.uint32)
  return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)


_UNSIGNED = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}
