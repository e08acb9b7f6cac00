"""The library's surface: ``__all__`` is the API, each name exported once, old names still import
(with a ``DeprecationWarning``), and nothing outside the library reaches past the surface."""

import ast
import doctest
import functools
import importlib
import re
import warnings

import pytest

import bv_sharding as bvs
from bv_sharding import ops
from tests.helpers import ROOT

API = {
    "optimizers",
    "plan",
    "Plan",
    "Entry",
    "infer_sharding",
    "make_mesh",
    "make_abstract_mesh",
    "check_coverage",
    "check_same_plan",
    "line_checksums",
    "gather_for_compute",
    "save_anything_but_gathers",
    "register",
    "registered",
    "lookup",
    "parse_chain",
    "Op",
    "OpInfo",
    "temporary_ops",
    "Error",
    "ShardingError",
    "ShardingWarning",
    "ops",
    "big_vision",
}
# The names ``bv_sharding`` exported before the surface was narrowed.
BEFORE = [
    "Entry",
    "Error",
    "Plan",
    "ShardingError",
    "ShardingWarning",
    "check_coverage",
    "check_same_plan",
    "flatten_with_names",
    "infer_sharding",
    "lookup",
    "make_abstract_mesh",
    "make_mesh",
    "parse_chain",
    "plan",
    "register",
    "ops",
    "registered",
    "temporary_ops",
]
# Old spelling -> (module, name) of the one exported spelling.
MOVED = {
    ("bv_sharding", "flatten_with_names"): ("bv_sharding.ops", "flatten_with_names"),
    ("bv_sharding.ops", "register"): ("bv_sharding", "register"),
    ("bv_sharding.ops", "registered"): ("bv_sharding", "registered"),
    ("bv_sharding.ops", "temporary_ops"): ("bv_sharding", "temporary_ops"),
    ("bv_sharding.coverage", "pieces"): ("bv_sharding.Plan", "pieces"),
    ("bv_sharding.coverage", "unsharded_bytes"): ("bv_sharding.Plan", "unsharded_bytes"),
    ("bv_sharding.coverage", "claims"): ("bv_sharding.Plan", "claims"),
}
OUTSIDE = ("trainers", "benchmarks", "configs", "examples", "tools")
PUBLIC_MODULES = {
    "bv_sharding": bvs.__all__,
    "bv_sharding.ops": ops.__all__,
    "bv_sharding.big_vision": bvs.big_vision.__all__,
    "bv_sharding.optimizers": bvs.optimizers.__all__,
    **{
        f"bv_sharding.big_vision.{name}": getattr(bvs.big_vision, name).__all__
        for name in bvs.big_vision.__all__
        if name != "ConfigError"
    },
}


def test_all_is_exactly_the_api_each_name_once():
  assert len(bvs.__all__) == len(set(bvs.__all__))
  assert set(bvs.__all__) == API
  assert len(ops.__all__) == len(set(ops.__all__))
  for module in (bvs, ops):
    assert all(hasattr(module, name) for name in module.__all__)


def test_each_object_is_exported_in_one_place():
  top = {id(getattr(bvs, name)) for name in bvs.__all__}
  assert [name for name in ops.__all__ if id(getattr(ops, name)) in top] == []


def test_lookup_and_parse_chain_return_exported_types():
  assert isinstance(bvs.lookup("fsdp"), bvs.OpInfo)
  chain = bvs.parse_chain('fsdp(axis="data")|replicate')
  assert [type(op) for op in chain] == [bvs.Op, bvs.Op]


@pytest.mark.parametrize("name", BEFORE)
def test_every_name_exported_before_still_imports(name):
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    exec(f"from bv_sharding import {name}", {})


@pytest.mark.parametrize("old", sorted(MOVED), ids=".".join)
def test_moved_names_are_aliases_that_warn_naming_the_replacement(old):
  module, name = old
  new_owner, new_name = MOVED[old]
  replacement = functools.reduce(getattr, [*new_owner.split(".")[1:], new_name], bvs)
  with pytest.warns(DeprecationWarning, match=re.escape(f"use {new_owner}.{new_name}")):
    alias = getattr(importlib.import_module(module), name)
  assert alias is replacement
  with pytest.warns(DeprecationWarning, match=re.escape(f"{module}.{name} is deprecated")):
    namespace = {}
    exec(f"from {module} import {name}", namespace)
  assert namespace[name] is replacement
  assert name not in getattr(importlib.import_module(module), "__all__", ())


def test_an_unknown_name_is_still_an_attribute_error():
  with pytest.raises(AttributeError, match="no attribute 'flatten_with_name'"):
    bvs.flatten_with_name  # noqa: B018
  with pytest.raises(ImportError):
    exec("from bv_sharding.ops import plan", {})


def violations(tree: ast.AST) -> list[str]:
  """Uses of ``bv_sharding`` in ``tree`` past its surface: a submodule imported, or a name
  taken from the package (or its ``ops`` namespace) that its ``__all__`` does not list."""
  aliases, found = {}, []
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      for a in node.names:
        if a.name.split(".")[0] != "bv_sharding":
          continue
        if a.name not in PUBLIC_MODULES:
          found.append(f"import {a.name}")
        aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else "bv_sharding"
    elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "bv_sharding":
      public = PUBLIC_MODULES.get(node.module)
      for a in node.names:
        if public is None or a.name not in public:
          found.append(f"from {node.module} import {a.name}")
        elif node.module == "bv_sharding" and a.name == "ops":
          aliases[a.asname or "ops"] = "bv_sharding.ops"
  for node in ast.walk(tree):
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
      module = aliases.get(node.value.id)
      if module is not None and node.attr not in PUBLIC_MODULES[module]:
        found.append(f"{node.value.id}.{node.attr}")
    elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute):
      inner = node.value
      if (
          isinstance(inner.value, ast.Name)
          and aliases.get(inner.value.id) == "bv_sharding"
          and inner.attr == "ops"
          and node.attr not in ops.__all__
      ):
        found.append(f"{inner.value.id}.ops.{node.attr}")
  return found


def examples(tree: ast.AST) -> list[ast.AST]:
  """The docstring examples (``>>>`` lines) of ``tree``'s module, classes and functions, parsed."""
  parser, parsed = doctest.DocTestParser(), []
  for node in ast.walk(tree):
    if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
      text = ast.get_docstring(node)
      source = "".join(e.source for e in parser.get_examples(text or ""))
      if source:
        parsed.append(ast.parse(source))
  return parsed


@pytest.mark.parametrize(
    "source",
    [
        "import bv_sharding.specs",
        "from bv_sharding.errors import closest",
        "from bv_sharding import traffic",
        "from bv_sharding.ops import register",
        "import bv_sharding as bvs\nbvs.specs.MiB",
        "import bv_sharding as bvs\nbvs.ops.Leaf, bvs.ops.register",
        "from bv_sharding import ops as o\no.register",
    ],
)
def test_the_scan_sees_every_way_past_the_surface(source):
  assert violations(ast.parse(source))


def test_the_scan_accepts_the_surface():
  source = (
      "import bv_sharding as bvs\nfrom bv_sharding import Plan, ops\n"
      "from bv_sharding.ops import place\nbvs.plan, bvs.ops.Leaf, ops.stack_axes"
  )
  assert violations(ast.parse(source)) == []


def test_nothing_outside_the_library_and_its_tests_imports_past_the_surface():
  found = []
  for folder in OUTSIDE:
    for path in sorted((ROOT / folder).rglob("*.py")):
      tree = ast.parse(path.read_text(), str(path))
      for part in (tree, *examples(tree)):
        found += [f"{path.relative_to(ROOT)}: {v}" for v in violations(part)]
  assert found == []


def test_the_library_text_speaks_of_the_library_only():
  words = re.compile(
      r"\btrainers?\b|\bthe seed\b|\b(configs|trainers|benchmarks|tests)[/.]\w", re.I
  )
  found = [
      f"{path.name}:{number}: {line.strip()}"
      for path in sorted((ROOT / "bv_sharding").rglob("*.py"))
      for number, line in enumerate(path.read_text().splitlines(), 1)
      if words.search(line)
  ]
  assert found == []
