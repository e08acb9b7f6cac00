"""The structure drawing and README's map (``tools/structure.py``): current, acyclic, never pointing up."""

import doctest

import pytest

from tests.helpers import ROOT, load_tool

structure = load_tool("structure")


def test_the_committed_page_is_what_the_tool_writes_now():
  assert (
      ROOT / structure.PAGE
  ).read_text() == structure.page(), (
      "docs/architecture.md is out of date: run `python tools/structure.py`"
  )
  assert structure.main(["--check"]) == 0


def test_the_readme_map_is_what_the_tool_writes_now():
  assert (
      ROOT / structure.README
  ).read_text() == structure.readme(), (
      "README.md's map of the code is out of date: run `python tools/structure.py`"
  )


def test_the_map_names_every_folder_and_module_of_the_code():
  lines = structure.code_map().splitlines()
  words = {w for line in lines for w in line.split()}
  for name, path in structure.modules().items():
    leaf = path.parent.name + "/" if path.name == "__init__.py" else path.stem
    assert leaf in words, f"{name} is missing from README's map"
  assert max(map(len, lines)) <= structure.MAP_WIDTH


def test_every_module_sits_in_one_declared_node():
  held = structure.holders()
  names = [node.name for layer in structure.LAYERS for node in layer.nodes]
  assert len(names) == len(set(names))
  assert all(structure.node_of(m, held) in names for m in structure.modules())
  assert structure.node_of("trainers.input.batching", held) == "trainers.input"
  assert structure.node_of("trainers.steps", held) == "trainers core"
  assert structure.node_of("trainers.train", held) == "commands"


def test_no_arrow_points_up():
  arrows = structure.graph()
  assert structure.upward(arrows, structure.node_layers()) == []
  assert "bv_sharding" in arrows["trainers.errors"] and arrows["bv_sharding"] == set()


def test_no_cycle_between_nodes_or_modules():
  assert structure.cycle(structure.graph()) is None
  assert structure.cycle(structure.module_graph()) is None


def test_the_docstring_examples_run():
  assert doctest.testmod(structure, optionflags=doctest.ELLIPSIS).failed == 0


@pytest.fixture
def tree(tmp_path):
  """A small project whose input package imports the steps, relatively and inside a function."""
  files = {
      "trainers/__init__.py": "",
      "trainers/steps.py": "import bv_sharding\n",
      "trainers/input/__init__.py": "",
      "trainers/input/batching.py": "def f():\n  from .. import steps\n",
      "trainers/input/sources.py": "from trainers.input import batching\n",
      "bv_sharding/__init__.py": "from trainers.input import sources\n",
  }
  for name, text in files.items():
    (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / name).write_text(text)
  return tmp_path


def test_the_checks_find_an_upward_import_and_a_cycle(tree):
  modules = structure.module_graph(tree)
  assert modules["trainers.input.batching"] == {"trainers.steps"}
  assert modules["trainers.input.sources"] == {"trainers.input.batching"}
  arrows = structure.graph(tree)
  assert structure.upward(arrows, structure.node_layers()) == [
      ("bv_sharding", "trainers.input"),
      ("trainers.input", "trainers core"),
  ]
  assert structure.cycle(arrows) == [
      "bv_sharding",
      "trainers.input",
      "trainers core",
      "bv_sharding",
  ]
  assert structure.cycle(modules)[0] == structure.cycle(modules)[-1]


def test_the_map_follows_a_new_module_and_its_folder_summary(tree):
  (tree / "trainers" / "input" / "__init__.py").write_text('"""Batches. More."""\n')
  (tree / "trainers" / "input" / "shuffle.py").write_text("")
  lines = [line for name in ("trainers",) for line in structure.folder_lines(tree / name, 0, tree)]
  assert lines == ["trainers/", "    steps", "  input/  Batches", "      batching shuffle sources"]


# Checks of the project as a whole, not of one module.
PROJECT_WIDE = {"docs", "doctests", "style", "warnings"}


def test_every_test_file_is_named_after_the_module_it_tests():
  names = {name.rpartition(".")[2] for name in structure.modules()}
  names |= {p.stem for p in (ROOT / "tools").glob("*.py")} | PROJECT_WIDE
  misnamed = [
      path.relative_to(ROOT).as_posix()
      for path in sorted((ROOT / "tests").rglob("test_*.py"))
      if not any(path.stem[5:] == n or path.stem[5:].startswith(n + "_") for n in names)
  ]
  assert misnamed == [], "name each test file test_<module>[_<aspect>].py"
