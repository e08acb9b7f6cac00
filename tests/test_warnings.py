"""pytest.ini's warning filters: a deprecation raised from the project's own code fails the test,
one raised from another package does not."""

import warnings

import pytest


def deprecate(module: str) -> None:
  warnings.warn_explicit("old spelling", DeprecationWarning, f"{module}.py", 1, module=module)


@pytest.mark.parametrize(
    "module",
    ["bv_sharding.mesh", "trainers.train", "configs.lm", "benchmarks.memory", "bv_config_file"],
)
def test_our_deprecations_fail(module):
  with pytest.raises(DeprecationWarning, match="old spelling"):
    deprecate(module)


@pytest.mark.parametrize(
    "module", ["jax._src.mesh", "flax.linen", "bv_sharding_fork", "tests.helpers"]
)
def test_other_deprecations_stay_quiet(module):
  deprecate(module)
