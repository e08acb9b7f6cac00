"""The project's structure, computed from its imports: packages by layer, drawn as a graph.

Every module of ``bv_sharding``, ``trainers``, ``benchmarks`` and ``configs`` belongs to one
node (the node naming its longest dotted prefix); a node's arrows go to the nodes its
modules import (any ``import`` statement, at the top of a file or inside a function). Nodes
sit in layers, top to bottom: a module imports only from its own layer or the ones below,
so the graph has no upward arrow, and it has no cycle. ``tests/test_structure.py`` checks
both, and that ``docs/architecture.md`` and README's map of the code (each folder's summary,
the first sentence of its ``__init__.py``, and its modules) are what this writes now::

  python tools/structure.py            # writes docs/architecture.md and README's map
  python tools/structure.py --check    # exits 1 when either is out of date

Example:
  >>> held = {"a": "A", "a.b": "AB"}
  >>> node_of("a.x", held), node_of("a.b.y", held), node_of("ab", held)
  ('A', 'AB', None)
  >>> upward({"A": {"AB"}, "AB": {"A"}}, {"A": 0, "AB": 1})
  [('AB', 'A')]
  >>> cycle({"a": {"b"}, "b": {"a"}}), cycle({"a": {"b"}, "b": set()})
  (['a', 'b', 'a'], None)
"""

import argparse
import ast
import dataclasses
import functools
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGE = pathlib.Path("docs") / "architecture.md"
PACKAGES = ("bv_sharding", "trainers", "benchmarks", "configs")
COMMANDS = (
    "trainers.train",
    "trainers.plan",
    "trainers.launch",
    "trainers.convert",
    "trainers.sample",
)


@dataclasses.dataclass(frozen=True)
class Node:
  """One box of the drawing: ``prefixes`` are the dotted module names (and their submodules)
  it holds; a ``listed`` box names its modules too."""

  name: str
  prefixes: tuple[str, ...]
  listed: bool = False


def packages(*names: str) -> tuple[Node, ...]:
  """One node per package, named after it."""
  return tuple(Node(name, (name,)) for name in names)


@dataclasses.dataclass(frozen=True)
class Layer:
  """Nodes at one height, and a paragraph saying what lives there."""

  title: str
  nodes: tuple[Node, ...]
  text: str


LAYERS = (
    Layer(
        "Entry points",
        (
            Node("commands", COMMANDS, listed=True),
            *packages("benchmarks"),
        ),
        "What people run. The commands (`python -m trainers.<command>`) read flags, build a run "
        "and call it; the benchmarks (`python -m benchmarks.<name>`) measure plans, memory, "
        "traffic and speed on the trainer's builds. Nothing imports them.",
    ),
    Layer(
        "Configs",
        packages("configs"),
        "`configs/*.py`: big_vision-style `get_config(arg)` files, a run's whole description "
        "(model, data, optimizer, mesh, sharding strategy) as code. The commands load them "
        "by path; they import only the data sources they name and the errors they raise.",
    ),
    Layer(
        "Run assembly",
        (Node("trainers core", ("trainers",), listed=True),),
        "The other modules at the top of `trainers/`: the run record built once from a "
        "config, where it starts (`start`: its checkpoint, `model_init` or a fresh init), the "
        "jitted train and eval steps, the loop and its hooks (metrics, preemption, the "
        "non-finite loss policy), the checks before a run, flags and one-line errors, "
        "`jax.distributed` start-up.",
    ),
    Layer(
        "Run directory",
        packages("trainers.rundir"),
        "`trainers/rundir/`: what a run leaves on disk and reads back: the work directory's "
        "files, provenance, orbax checkpoints saved and read back onto a plan. What a run "
        "makes of them (resume, `model_init`, a fresh init) is the run's (`trainers.start`).",
    ),
    Layer(
        "Parts",
        packages("trainers.input", "trainers.models", "trainers.optimizers"),
        "What a run is built from, each knowing nothing of the others: `input/` (sources, "
        "deterministic batches, prefetch, tasks), `models/` (Llama and ViT), `optimizers/` "
        "(the registry, Kron, Shampoo and Muon on the params' layout; big_vision's optimizer "
        "section through the library's `bv_sharding.big_vision`).",
    ),
    Layer(
        "Trainer basics",
        packages("trainers.errors", "trainers.precision", "trainers.settings.schema"),
        "`trainers.errors`: the trainer's error kinds (`ConfigError`, `OptimizerError`, "
        "`NonFiniteLossError`) under the library's `bv_sharding.Error`, and the did-you-mean "
        "hints their messages end with; `trainers.precision`: the dtypes a config asks for "
        "(compute, stored params, optimizer state), read by the models and the optimizers; "
        "`trainers.settings.schema`: the config's keys declared once (types, defaults), the "
        "typed config every module above reads as attributes.",
    ),
    Layer(
        "Library",
        # The drop-in is the library's: bv_sharding exports it, so it cannot be a node above.
        (Node("bv_sharding", ("bv_sharding", "bv_sharding.big_vision")),),
        "`bv_sharding/`: sharding plans for params and optimizer state, from a config's "
        "strategy, before any array exists. It imports nothing of the project; everything "
        "above uses it through its public names (`bv_sharding.__all__`, `bv_sharding.ops` and "
        "`bv_sharding.big_vision`, the drop-in for big_vision's `sharding` and `optax` modules "
        "with big_vision's schedules and optimizer chain).",
    ),
)


def node_layers(layers=LAYERS) -> dict[str, int]:
  """Node name -> its layer's index (0 at the top)."""
  return {node.name: i for i, layer in enumerate(layers) for node in layer.nodes}


def holders(layers=LAYERS) -> dict[str, str]:
  """Dotted prefix -> the node holding the modules it names."""
  return {p: node.name for layer in layers for node in layer.nodes for p in node.prefixes}


def node_of(module: str, held: dict[str, str]) -> str | None:
  """The node of ``held`` (prefix -> node) with the longest prefix of ``module``, or ``None``."""
  matches = [p for p in held if module == p or module.startswith(p + ".")]
  return held[max(matches, key=len)] if matches else None


def modules(root: pathlib.Path = ROOT) -> dict[str, pathlib.Path]:
  """Dotted module name -> file, for every module of the packages."""
  found = {}
  for package in PACKAGES:
    for path in sorted((root / package).rglob("*.py")):
      parts = path.relative_to(root).with_suffix("").parts
      found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
  return found


def imports(path: pathlib.Path, name: str, known) -> set[str]:
  """The project modules the file ``path`` (module ``name``) imports, anywhere in it."""
  package = name if path.name == "__init__.py" else name.rpartition(".")[0]
  found = set()
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Import):
      found.update(a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom):
      base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
      module = ".".join([*base, *([node.module] if node.module else [])])
      found.update(
          f"{module}.{a.name}" if f"{module}.{a.name}" in known else module for a in node.names
      )
  return {m for m in found if m in known and m != name}


@functools.cache
def module_graph(root: pathlib.Path = ROOT) -> dict[str, set[str]]:
  """Module -> the project modules it imports."""
  known = modules(root)
  return {name: imports(path, name, known) for name, path in known.items()}


def graph(root: pathlib.Path = ROOT, layers=LAYERS) -> dict[str, set[str]]:
  """Node -> the nodes its modules import (itself left out), every node of ``layers`` a key."""
  held = holders(layers)
  arrows = {name: set() for name in node_layers(layers)}
  for module, imported in module_graph(root).items():
    source = node_of(module, held)
    arrows[source] |= {node_of(m, held) for m in imported} - {source}
  return arrows


def upward(arrows: dict[str, set[str]], nodes: dict[str, int]) -> list[tuple[str, str]]:
  """Arrows from a node to one in a layer above it."""
  return sorted((a, b) for a, targets in arrows.items() for b in targets if nodes[b] < nodes[a])


def cycle(arrows: dict[str, set[str]]) -> list[str] | None:
  """One cycle of ``arrows`` as a path that ends where it starts, or ``None`` (depth first)."""
  done, path = set(), []

  def visit(node):
    if node in path:
      return path[path.index(node) :] + [node]
    if node in done:
      return None
    path.append(node)
    for target in sorted(arrows.get(node, ())):
      found = visit(target)
      if found:
        return found
    done.add(path.pop())
    return None

  for node in sorted(arrows):
    found = visit(node)
    if found:
      return found
  return None


def _id(name: str) -> str:
  return name.replace(".", "_").replace(" ", "_")


def label(node: Node, root: pathlib.Path = ROOT, layers=LAYERS) -> str:
  """What ``node``'s box says: its name, and for a listed node its modules' last names."""
  if not node.listed:
    return node.name
  held = holders(layers)
  names = [m.rpartition(".")[2] for m in module_graph(root) if node_of(m, held) == node.name]
  return f"{node.name}: {', '.join(n for n in names if n not in node.prefixes)}"


def mermaid(arrows: dict[str, set[str]], root: pathlib.Path = ROOT, layers=LAYERS) -> str:
  """The graph as a mermaid ``graph TD``: one subgraph per layer, arrows importer -> imported."""
  lines = ["graph TD"]
  for i, layer in enumerate(layers):
    lines.append(f'  subgraph L{i}["{layer.title}"]')
    for node in layer.nodes:
      lines.append(f'    {_id(node.name)}["{label(node, root, layers)}"]')
    lines.append("  end")
  for source in sorted(arrows):
    lines += [f"  {_id(source)} --> {_id(target)}" for target in sorted(arrows[source])]
  return "\n".join(lines)


def page(root: pathlib.Path = ROOT, layers=LAYERS) -> str:
  """``docs/architecture.md``: the drawing, then one paragraph per layer, top to bottom."""
  parts = [
      "# Architecture",
      "",
      "The project's packages by layer, computed from their imports by `python "
      "tools/structure.py` (which writes this page; `tests/test_structure.py` checks that "
      "it is current). An arrow goes from the importer to the imported. A module imports "
      "only from its own layer or the layers below, and the imports have no cycle.",
      "",
      "```mermaid",
      mermaid(graph(root, layers), root, layers),
      "```",
  ]
  for layer in layers:
    parts += ["", f"## {layer.title}", "", layer.text]
  return "\n".join(parts) + "\n"


MAP_ROOTS = ("bv_sharding", "trainers", "configs", "benchmarks", "tests", "tools", "examples")
MAP_WIDTH = 100
README = pathlib.Path("README.md")
MAP_START = "<!-- map: written by tools/structure.py -->"
MAP_END = "<!-- map end -->"


def first_sentence(path: pathlib.Path) -> str:
  """The first sentence of the docstring of the module at ``path``, as plain text, or ``""``."""
  text = ast.get_docstring(ast.parse(path.read_text())) if path.exists() else None
  first = " ".join((text or "").split("\n\n")[0].split()).split(". ")[0]
  return first.replace(":mod:", "").replace("`", "").rstrip(".:")


def wrapped(head: str, words: list[str], indent: str) -> list[str]:
  """``head`` then ``words``, in lines of at most ``MAP_WIDTH``, later lines at ``indent``."""
  lines, row = [], head
  for word in words:
    if len(row) + len(word) + 1 > MAP_WIDTH and row.strip():
      lines.append(row)
      row = indent
    row += f" {word}"
  return [line.rstrip() for line in (*lines, row)]


def folder_lines(folder: pathlib.Path, depth: int, root: pathlib.Path) -> list[str]:
  """``folder`` with its summary, then its modules: named in a package (its ``__init__.py``
  has the summary; under ``tests/`` the names mirror the code and are left out), each with
  its own summary in a folder of scripts; then its subfolders."""
  indent, package = "  " * depth, (folder / "__init__.py").exists()
  name = f"{indent}{folder.relative_to(root).as_posix()}/ "
  lines = wrapped(name, first_sentence(folder / "__init__.py").split(), indent + "   ")
  modules = sorted(p for p in folder.glob("*.py") if p.name != "__init__.py")
  if not package:
    for module in modules:
      head = f"{indent}  {module.stem} "
      lines += wrapped(head, first_sentence(module).split(), indent + "     ")
  elif root.name != "tests" and folder.name != "tests":
    lines += wrapped(indent + "   ", [m.stem for m in modules], indent + "   ") if modules else []
  for sub in sorted(p for p in folder.iterdir() if p.is_dir() and any(p.glob("*.py"))):
    lines += folder_lines(sub, depth + 1, folder)
  return lines


def code_map(root: pathlib.Path = ROOT) -> str:
  """README's map of the code: each folder with its summary and its modules, top to bottom.

  Example:
    >>> print(code_map().splitlines()[0])
    bv_sharding/  Config-driven sharding plans for Flax params and any optax optimizer state
  """
  return "\n".join(line for name in MAP_ROOTS for line in folder_lines(root / name, 0, root))


def readme(root: pathlib.Path = ROOT) -> str:
  """README.md with its map of the code as :func:`code_map` writes it now."""
  text = (root / README).read_text()
  head, rest = text.split(MAP_START + "\n", 1)
  tail = rest.split(MAP_END, 1)[1]
  return f"{head}{MAP_START}\n```\n{code_map(root)}\n```\n{MAP_END}{tail}"


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--check", action="store_true", help="exit 1 if a page is out of date")
  args = parser.parse_args(argv)
  stale = 0
  for path, text in ((PAGE, page()), (README, readme())):
    current = (ROOT / path).read_text() if (ROOT / path).exists() else ""
    if args.check:
      print(f"{path} is {'current' if current == text else 'out of date'}")
      stale += current != text
    elif current != text:
      (ROOT / path).write_text(text)
      print(f"wrote {path}")
  return int(stale > 0)


if __name__ == "__main__":
  sys.exit(main())
