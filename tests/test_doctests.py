"""Every docstring example in the packages runs: ``>>>`` lines are doctests, checked here.

Each module's examples run with the module's own globals, on the 8 simulated CPU
devices of ``conftest.py``.
"""

import doctest
import importlib
import pkgutil

import pytest

import benchmarks
import bv_sharding
import configs
import trainers

# Entry points that define absl flags or set process-wide jax config when imported; their
# docstrings hold command lines, not examples.
NOT_IMPORTED = {
    "trainers.train",
    "benchmarks.communication",
    "benchmarks.memory",
    "benchmarks.throughput",
}


def modules(package) -> list[str]:
  """Dotted names of ``package`` and every module below it."""
  found = [package.__name__]
  for info in pkgutil.walk_packages(package.__path__, prefix=package.__name__ + "."):
    found.append(info.name)
  return sorted(set(found) - NOT_IMPORTED)


MODULES = [
    name for package in (bv_sharding, trainers, configs, benchmarks) for name in modules(package)
]


def test_every_library_module_is_collected():
  assert {
      "bv_sharding.planning",
      "bv_sharding.registry",
      "trainers.steps",
      "benchmarks.zoo",
  } <= set(MODULES)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
  module = importlib.import_module(name)
  finder = doctest.DocTestFinder(exclude_empty=True)
  runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
  report = []
  for test in finder.find(module, name):
    runner.run(test, out=report.append)
  assert runner.failures == 0, "".join(report)
