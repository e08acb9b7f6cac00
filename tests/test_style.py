"""The house style holds everywhere: pyink formatting and ruff lint, as configured in pyproject.toml."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize(
    "tool",
    [["pyink", "--check", "--quiet", "."], ["ruff", "check", "--quiet", "."]],
    ids=["pyink", "ruff"],
)
def test_tree_follows_the_house_style(tool):
  result = subprocess.run(
      [sys.executable, "-m", *tool], cwd=ROOT, capture_output=True, text=True, timeout=240
  )
  assert result.returncode == 0, (
      f"{tool[0]} found problems; run `{' '.join(tool).replace('--check ', '')}` "
      f"(ruff: add --fix):\n{result.stdout}{result.stderr}"
  )
