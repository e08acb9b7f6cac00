"""bv_sharding against big_vision's own placements, recorded as data.

``tests/data/big_vision_placements.json`` holds what big_vision's
``sharding.infer_sharding`` gives every param leaf of ViT-B/16, ViT-L/16,
So400m/14, PaliGemma (So400m/14 + Gemma 2B) and this project's Llama 125m / 7b
for its own strategies (``fsdp``, ``replicate``, ``shard_dim``, bare names,
positional arguments) on 1-D and 2-D meshes of 8 and 256 devices. It was
recorded by ``tools/record_big_vision.py`` from big_vision commit
``RECORDED_COMMIT`` (big_vision is not on PyPI; none of its code is here).

Every leaf must get big_vision's spec, with one explained exception (docs/differences.md): where big_vision puts an axis on a dim
that axis does not divide (a spec ``jax.jit`` rejects), the dim stays unsharded.
"""

import functools
import json
import math
import pathlib
import re
import warnings

import jax
import jax.numpy as jnp
import pytest

import bv_sharding as bvs

DATA = pathlib.Path(__file__).resolve().parents[1] / "data" / "big_vision_placements.json"
RECORDED_COMMIT = "0127fb6b337ee2a27bf4e54dea79cff176527356"  # big_vision main, 2025-05-19


@functools.cache
def recorded() -> dict:
  return json.loads(DATA.read_text())


def _norm(entry):
  if entry is None:
    return None
  return (entry,) if isinstance(entry, str) else tuple(entry)


def _spec(spec, ndim):
  spec = [_norm(e) for e in spec]
  return tuple(spec + [None] * (ndim - len(spec)))


def _valid(spec, shape, mesh_sizes):
  return all(
      e is None or shape[d] % math.prod(mesh_sizes[a] for a in e) == 0 for d, e in enumerate(spec)
  )


def _tree(tree_name):
  """Nested dicts of ShapeDtypeStructs under "params", named as big_vision names them."""
  root = {}
  for name, (shape, dtype) in recorded()["trees"][tree_name].items():
    *path, last = name.split("/")
    node = root
    for key in path:
      node = node.setdefault(key, {})
    node[last] = jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype))
  return root


def test_recorded_data_describes_the_named_commit_and_every_model_and_mesh():
  data = recorded()
  assert data["big_vision_commit"] == RECORDED_COMMIT
  assert set(data["trees"]) == {
      "vit_b16",
      "vit_l16",
      "so400m14",
      "paligemma_3b",
      "llama_125m",
      "llama_7b_scan",
  }
  meshes = {r["mesh"] for r in data["runs"]}
  assert {"data256", "data64_model4", "data2_model4"} <= meshes
  # The ViT-L/16 attention kernels are exactly 4 MiB: big_vision leaves them unsharded.
  shape, _ = data["trees"]["vit_l16"][
      "params/Transformer/encoderblock_0/MultiHeadDotProductAttention_0/query/kernel"
  ]
  assert math.prod(shape) * 4 == 4 * 2**20


@pytest.mark.parametrize("tree_name", sorted(json.loads(DATA.read_text())["trees"]))
def test_same_param_placements_as_big_vision(tree_name):
  data = recorded()
  tree = _tree(tree_name)
  shapes = {n: tuple(s) for n, (s, _) in data["trees"][tree_name].items()}
  compared = 0
  for run in (r for r in data["runs"] if r["tree"] == tree_name):
    mesh_pairs = [tuple(p) for p in data["meshes"][run["mesh"]]]
    sizes = dict(mesh_pairs)
    mesh = bvs.make_abstract_mesh(mesh_pairs, math.prod(sizes.values()))
    strategy = [tuple(p) for p in data["strategies"][run["strategy"]]]
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      ours = {e.name: e for e in bvs.plan(tree, strategy, mesh).entries}
    # An entry that matches no leaf (frozen_img's ".*/img/.*" on a model without an image
    # tower) is pointed out; nothing else warns.
    unused = [regex for regex, _ in strategy if not any(re.fullmatch(regex, n) for n in shapes)]
    expected = [f"strategy entries {unused} match no leaf"] if unused else []
    assert [str(w.message).split(" of the tree")[0] for w in caught] == expected
    assert all(issubclass(w.category, bvs.ShardingWarning) for w in caught)
    assert set(ours) == set(shapes)
    for name, shape in shapes.items():
      theirs = _spec(run["sharded"].get(name, ()), len(shape))
      mine = _spec(ours[name].spec, len(shape))
      compared += 1
      if _valid(theirs, shape, sizes):
        assert mine == theirs, (run["mesh"], run["strategy"], name, shape, ours[name].why)
      else:  # big_vision's spec is one jit rejects: the dim is left unsharded here.
        assert "shard_dim" in run["strategy"]  # big_vision's fsdp checks divisibility.
        assert _valid(mine, shape, sizes)
        assert "not divisible" in ours[name].why, ours[name].why
  assert compared == len(shapes) * sum(r["tree"] == tree_name for r in data["runs"])


def test_recorded_data_has_specs_jit_rejects():
  """big_vision's shard_dim puts "model" (4) on dims of 1 and 27: the explained case occurs."""
  data = recorded()
  invalid = [
      name
      for run in data["runs"]
      for name, spec in run["sharded"].items()
      if not _valid(
          _spec(spec, len(data["trees"][run["tree"]][name][0])),
          data["trees"][run["tree"]][name][0],
          dict(tuple(p) for p in data["meshes"][run["mesh"]]),
      )
  ]
  assert len(invalid) > 10
