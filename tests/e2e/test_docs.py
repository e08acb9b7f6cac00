"""The docs' code runs: every ```python block of README.md and docs/*.md, exactly as written.

Each block runs on its own (a fresh namespace, in a temporary working directory) in this
process, whose 8 simulated CPU devices ``conftest.py`` set up; shell commands sit in
```bash blocks, which are illustrations and are not run.
"""

import contextlib
import io
import pathlib
import re

import pytest
from jax.sharding import PartitionSpec as P

import bv_sharding as bvs

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 250


def python_blocks(page: pathlib.Path) -> list[str]:
  """The ```python blocks of ``page``, in order."""
  return re.findall(r"^```python\n(.*?)^```$", page.read_text(), re.S | re.M)


def run_block(code: str) -> tuple[dict, str]:
  """``(namespace, stdout)`` of ``code`` run as a script of its own."""
  namespace, out = {"__name__": "__main__"}, io.StringIO()
  with contextlib.redirect_stdout(out):
    exec(compile(code, "<docs>", "exec"), namespace)
  return namespace, out.getvalue()


BLOCKS = [
    pytest.param(code, id=f"{page.relative_to(ROOT)}[{i}]")
    for page in PAGES
    for i, code in enumerate(python_blocks(page))
]


@pytest.mark.parametrize("code", BLOCKS)
def test_block_runs_and_leaves_the_registry_as_it_was(code, tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  before = bvs.registered()
  run_block(code)
  assert bvs.registered() == before


def test_readme_and_every_docs_page_with_code_are_found():
  names = {p.relative_to(ROOT).as_posix() for p in PAGES if python_blocks(p)}
  assert names == {
      "README.md",
      "docs/big_vision.md",
      "docs/data.md",
      "docs/durability.md",
      "docs/explicit.md",
      "docs/optimizers.md",
      "docs/planning.md",
      "docs/strategies.md",
  }


def test_readme_is_a_five_minute_read():
  assert len((ROOT / "README.md").read_text().splitlines()) <= README_MAX_LINES


def test_write_your_own_op_example_plans_rows_over_data():
  (code,) = [c for c in python_blocks(ROOT / "docs" / "strategies.md") if "def shard_rows" in c]
  namespace, out = run_block(code)
  entries = namespace["plan"].by_name()
  assert entries["dense/kernel"].spec == P("data", None)
  assert entries["dense/kernel"].why == "'.*' -> shard_rows: dim 0 over data"
  assert entries["dense/bias"].spec == P(None)
  assert "fewer than 2 dims" in entries["dense/bias"].why
  assert "dense/kernel" in out
