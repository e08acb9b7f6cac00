"""trainers/rundir/checksums.py: the same sums in every layout, each as its format defines it
(format 1 is what checkpoints saved before format 2 hold), and the damage each one finds."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from trainers.rundir import checksums

RNG = np.random.default_rng(0)
VALUES = {
    "f32": RNG.standard_normal((16, 24)).astype(np.float32),
    "bf16": RNG.standard_normal((8, 16)).astype(jnp.bfloat16),
    "i8": RNG.integers(-128, 127, (8, 8)).astype(np.int8),
    "bool": RNG.random((4, 16)) > 0.5,
    "scalar": np.float32(3.5),
    "odd": RNG.standard_normal((3, 5)).astype(np.float32),
    "cube": RNG.standard_normal((4, 6, 8)).astype(np.float32),
}


def mesh(shape, names, explicit=False):
  if explicit:
    return jax.make_mesh(shape, names)  # Explicit axes.
  return Mesh(np.array(jax.devices()[: np.prod(shape)]).reshape(shape), names)


LAYOUTS = {
    "one device": lambda v: jax.device_put(v, SingleDeviceSharding(jax.devices()[3])),
    "rows over 8": lambda v: put(v, mesh((8,), ("data",)), P("data") if v.ndim else P()),
    "replicated": lambda v: put(v, mesh((8,), ("data",)), P()),
    "2 x 4, both axes": lambda v: put(v, mesh((2, 4), ("a", "b")), P(*("a", "b")[: v.ndim])),
    "one dim over 2 axes": lambda v: put(v, mesh((2, 4), ("a", "b")), P(("b", "a"))[: v.ndim]),
    "2 x 2 x 2": lambda v: put(v, mesh((2, 2, 2), ("x", "y", "z")), P(None, ("z", "x"))),
    "explicit axes": lambda v: put(v, mesh((2, 4), ("a", "b"), True), P(None, "a")),
}


def put(value, on, spec):
  """``value`` on mesh ``on`` as ``spec`` says where each dimension divides, else replicated."""
  spec = tuple(spec)[: np.ndim(value)]
  fits = all(
      entry is None or value.shape[d] % np.prod([on.shape[a] for a in np.atleast_1d(entry)]) == 0
      for d, entry in enumerate(spec)
  )
  return jax.device_put(value, NamedSharding(on, P(*spec) if fits else P()))


def words(value) -> np.ndarray:
  """``value``'s elements as uint32 words, row-major (64-bit elements as two)."""
  value = np.asarray(value)
  if value.dtype == bool:
    return value.reshape(-1).astype(np.uint32)
  if value.dtype.itemsize == 8:
    return value.reshape(-1).view(np.uint32)
  unsigned = {1: np.uint8, 2: np.uint16, 4: np.uint32}[value.dtype.itemsize]
  return value.reshape(-1).view(unsigned).astype(np.uint32)


def format_1(value) -> int:
  """Format 1 as written before format 2: sum(bits * (2 i + 1)) mod 2**32."""
  w = words(value).astype(np.uint64)
  return int(np.sum(w * (2 * np.arange(w.size, dtype=np.uint64) + 1) % 2**32) % 2**32)


def format_2(value) -> int:
  """Format 2 in numpy: murmur3's finalizer of bits ^ (i * 0x9E3779B9), summed mod 2**32."""
  with np.errstate(over="ignore"):
    x = words(value) ^ (np.arange(words(value).size, dtype=np.uint32) * np.uint32(0x9E3779B9))
    x = (x ^ (x >> 16)) * np.uint32(0x85EBCA6B)
    x = (x ^ (x >> 13)) * np.uint32(0xC2B2AE35)
    return int(np.sum(x ^ (x >> 16), dtype=np.uint32))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_layout_gives_each_formats_sums(layout):
  tree = {name: LAYOUTS[layout](value) for name, value in VALUES.items()}
  assert checksums.of(tree, 1) == {name: format_1(v) for name, v in VALUES.items()}
  assert checksums.of(tree) == {name: format_2(v) for name, v in VALUES.items()}


def test_the_format_a_save_writes_is_pinned():
  assert checksums.FORMAT == 2
  assert checksums.of({"v": jnp.arange(6)}) == {"v": format_2(np.arange(6, dtype=np.int32))}
  assert format_2(np.arange(6, dtype=np.int32)) == 2535500553


def changed(value, change) -> np.ndarray:
  copy = np.array(value, copy=True)
  change(copy.reshape(-1).view(np.uint32))
  return copy


def test_every_single_bit_flip_changes_the_sum():
  value = VALUES["f32"]
  want = format_2(value)
  layout = LAYOUTS["2 x 4, both axes"]
  flips = [(i, b) for i in (0, 1, 23, 24, 200, 383) for b in range(32)]
  for i, b in flips:
    flipped = changed(value, lambda w, i=i, b=b: w.__setitem__(i, w[i] ^ np.uint32(1 << b)))
    assert format_2(flipped) != want, (i, b)
  # The devices' sums agree with numpy's on a sample of them.
  for i, b in flips[::37]:
    flipped = changed(value, lambda w, i=i, b=b: w.__setitem__(i, w[i] ^ np.uint32(1 << b)))
    assert checksums.of({"w": layout(flipped)})["w"] == format_2(flipped)


@pytest.mark.parametrize(
    "swap",
    [
        "neighbours",
        "x and -x",  # Format 1 misses it: their bits differ by 2**31.
        "rows 2**3 apart",
        "blocks 2**7 apart",  # Format 1 misses it when the blocks' sums agree mod 2**24.
    ],
)
def test_swapped_elements_change_the_sum(swap):
  value = VALUES["f32"].copy()
  if swap == "x and -x":
    value[0, 1] = -value[0, 0]
  if swap == "blocks 2**7 apart":
    value.reshape(-1)[128:136] = value.reshape(-1)[:8][::-1]  # Same sum, other order.
  swapped = value.copy()
  flat = swapped.reshape(-1)
  if swap in ("neighbours", "x and -x"):
    flat[[0, 1]] = flat[[1, 0]]
  elif swap == "rows 2**3 apart":
    swapped[[0, 8]] = swapped[[8, 0]]
  else:
    flat[:8], flat[128:136] = value.reshape(-1)[128:136], value.reshape(-1)[:8]
  assert not np.array_equal(swapped, value)
  assert format_2(swapped) != format_2(value)
  on = LAYOUTS["rows over 8"]
  assert checksums.of({"w": on(swapped)}) != checksums.of({"w": on(value)})
  if swap == "x and -x":
    assert format_1(swapped) == format_1(value)


def test_a_checkpoint_without_sums_or_with_format_1_is_checked_as_saved():
  """What restore_item does with a meta: no "sums", nothing checked; no "sums_format", 1."""
  value = {"w": LAYOUTS["rows over 8"](VALUES["f32"])}
  old = checksums.of(value, 1)
  assert checksums.mismatch({}, checksums.of(value)) is None
  assert checksums.mismatch(old, checksums.of(value, 1)) is None
  assert checksums.mismatch(old, checksums.of(value)) == "w"  # Not to be read as format 2.


def test_a_meta_that_records_the_format_must_hold_every_sum():
  """What restore_item does with a meta that records "sums_format": a leaf read without a saved
  sum is damage, as a sum that differs is (sums removed from the meta hide nothing)."""
  read = checksums.of({"w": LAYOUTS["rows over 8"](VALUES["f32"]), "b": jnp.ones(3)})
  whole = {"sums": read, "sums_format": checksums.FORMAT}
  assert checksums.recorded(whole) == 2 and checksums.damage(whole, read) is None
  missing = "its meta records checksum format 2 but no checksum of {} (its meta was changed "
  assert checksums.damage({"sums_format": 2}, read).startswith(missing.format("b"))
  assert checksums.damage({"sums": None, "sums_format": 2}, read).startswith(missing.format("b"))
  one_gone = {"sums": {"b": read["b"]}, "sums_format": 2}
  assert checksums.damage(one_gone, read).startswith(missing.format("w"))
  changed = {"sums": {**read, "b": read["b"] + 1}, "sums_format": 2}
  assert checksums.damage(changed, read).startswith("b does not match the checksum saved with it")


def test_a_meta_without_the_format_is_checked_as_saved_before_it():
  """No "sums_format": format 1 sums, checked where saved; neither: nothing to check."""
  value = {"w": LAYOUTS["rows over 8"](VALUES["f32"])}
  old = {"sums": checksums.of(value, 1)}
  assert checksums.recorded(old) == 1 and checksums.damage(old, checksums.of(value, 1)) is None
  assert checksums.damage(old, checksums.of(value)) is not None  # Not format 2's sums.
  assert checksums.recorded({"step": 8}) is None and checksums.recorded({"sums": {}}) is None
