"""The README's code that claims to run, runs: the "Write your own op" example, exactly as written."""

import contextlib
import io
import pathlib
import re

from jax.sharding import PartitionSpec as P

import bv_sharding as bvs

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"


def python_block(section: str) -> str:
  """The first ```python block under the heading ``section``."""
  text = README.read_text()
  start = text.index(f"\n{section}\n")
  return re.search(r"```python\n(.*?)```", text[start:], re.S).group(1)


def test_write_your_own_op_example_runs_and_leaves_the_registry_as_it_was():
  before = bvs.registered()
  namespace, out = {}, io.StringIO()
  with contextlib.redirect_stdout(out):
    exec(python_block("### Write your own op"), namespace)
  entries = namespace["plan"].by_name()
  assert entries["dense/kernel"].spec == P("data", None)
  assert entries["dense/kernel"].why == "'.*' -> shard_rows: dim 0 over data"
  assert entries["dense/bias"].spec == P(None)
  assert "fewer than 2 dims" in entries["dense/bias"].why
  assert "dense/kernel" in out.getvalue()
  assert bvs.registered() == before
