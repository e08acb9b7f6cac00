"""Every test process sees 8 simulated CPU devices (the CPU backend, also on an accelerator
host), gives OpenBLAS one thread, compiles fast and
shares one jax compilation cache.

OpenBLAS threads fight XLA's on small hosts (``trainers/__init__.py`` says why). The cache is a
directory made for the session (or ``$JAX_COMPILATION_CACHE_DIR`` when set) in which every
program that took ``MIN_COMPILE_SECONDS`` or more to compile is kept, so a step compiled once
is loaded by every later test, pytest-xdist worker and trainer subprocess that compiles it
again. Each entry is read and written under jax's file lock (a worker once read another's
half-written entry and aborted), and each write first lists and reads the whole directory (jax's
eviction check), so the quick programs are left out: keeping every eager op's program too made
each write slower than the last (the example of Kron's ``triangular_inverse``: 2 s in an empty
cache, 21 s with 6,000 entries there; the whole suite's doctests 555 s, against 110 s with this
threshold, which leaves the suite 791 entries). A multi-device XLA:CPU program loaded from the
cache orders its collectives by their data alone (each deserialized collective gets an ordering
resource of its own), where a fresh compile orders them all: a collective that nothing reads
can then run in another order on another device and deadlock, which hung a resumed trainer run
while the pools' write-backs ran under ``lax.cond`` (on CPU devices they no longer do:
``gating.skips_here``, docs/optimizers.md). Both settings reach the subprocesses tests start
through the environment, and so does the last: XLA:CPU compiling for speed of compile
(``FAST_COMPILE``). The tests' models are tiny and run a few steps each, so compiling is what
they wait on. LLVM at its lowest optimisation
level halved a tiny Kron step's compile (30 s -> 15 s; it runs in 0.16 s instead of 0.07 s);
copy insertion without region analysis takes a quarter off the rest (the trainer's Kron step on
configs/lm.py, tiny: 30.8 -> 23.4 CPU seconds); XLA:CPU's older elemental emitters instead of
its fusion emitters halve it again (23.4 -> 12.6; the trainer's SOAP step on configs/lm_tp_fsdp.py
8.3 -> 5.8 s), and took the whole suite from 1455 s to 937 s on a 2-core host (2026-12-04). The
HLO passes that place and count collectives are unchanged (each step's wire bytes identical;
the compiled instructions within 4%, tests/benchmarks/test_step_traffic.py). The numerics are
not bit for bit XLA:CPU's default ones, but the same on any mesh as closely: Kron's and
Shampoo's runs through the trainer on 2, 4, 8 and 4x2 devices within 4.8e-6 of one device's
with either emitters, SOAP's library trajectory within 3.0e-6 (2.1e-6 with fusion emitters).
(Measured again after SOAP's bases became canonical: before, its trajectory drifted to 2.4e-4
with these emitters, and the tests kept the fusion ones.)

The modules holding the longest tests (by their ``timeout`` marks) run first, each module kept
whole (its module fixtures are made once per worker): pytest-xdist hands tests out in this
order (after the ``xdist_group`` ones, pytest.ini), so the short ones fill both workers' last
minutes instead of one long test running alone.
"""

import os
import shutil
import tempfile

from trainers import ONE_BLAS_THREAD

os.environ.setdefault(*ONE_BLAS_THREAD)
# The tests run on CPU devices everywhere, also on a TPU or GPU host (and its subprocesses).
os.environ["JAX_PLATFORMS"] = "cpu"
FAST_COMPILE = (
    "--xla_backend_optimization_level=0",
    "--xla_cpu_copy_insertion_use_region_analysis=false",
    "--xla_cpu_use_fusion_emitters=false",
)
missing = [flag for flag in FAST_COMPILE if flag not in os.environ.get("XLA_FLAGS", "")]
os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), *missing]).strip()


CACHE_LIMIT = 2**36  # 64 GiB, never reached: the whole suite writes tens of MiB.
MIN_COMPILE_SECONDS = 0.3  # A sixth of the entries of keeping every program (test_kron.py).


def shared_compilation_cache() -> str | None:
  """Points jax's persistent cache at a new directory, unless one is set; returns it if made.
  The cache's settings apply to a directory given too (the user's, or the xdist controller's)."""
  # A size limit (never reached) turns on jax's file lock around every read and write of an
  # entry: without it a process can read another's entry half written and abort in XLA.
  os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(CACHE_LIMIT))
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", str(MIN_COMPILE_SECONDS))
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")
  if "JAX_COMPILATION_CACHE_DIR" in os.environ:
    return None
  path = tempfile.mkdtemp(prefix="bv-sharding-jax-cache-")
  os.environ["JAX_COMPILATION_CACHE_DIR"] = path
  return path


MADE_CACHE = shared_compilation_cache()

import jax  # noqa: E402  (reads the cache settings from the environment)

jax.config.update("jax_num_cpu_devices", 8)


def timeout_of(item) -> float:
  """The seconds of ``item``'s ``timeout`` mark; 0 without one."""
  mark = item.get_closest_marker("timeout")
  return mark.args[0] if mark and mark.args else 0


def longest_first(items: list) -> list:
  """``items`` grouped by module, the modules ordered by their longest ``timeout`` mark, longest
  first (ties in the order given).

  >>> class Test:
  ...   def __init__(self, path, timeout=None):
  ...     self.path, self.timeout = path, timeout
  ...   def get_closest_marker(self, name):
  ...     return self.timeout and type("Mark", (), {"args": (self.timeout,)})
  >>> tests = [Test("a"), Test("b"), Test("a", 600), Test("c", 900)]
  >>> [(t.path, t.timeout) for t in longest_first(tests)]
  [('c', 900), ('a', None), ('a', 600), ('b', None)]
  """
  modules = {}
  for item in items:
    modules.setdefault(item.path, []).append(item)
  ordered = sorted(modules.values(), key=lambda tests: -max(map(timeout_of, tests)))
  return [item for tests in ordered for item in tests]


def grouped(item) -> None:
  """Tags ``item``'s node id with its ``xdist_group`` (``<id>@<group>``), which pytest-xdist's
  ``--dist loadgroup`` scheduler reads to send a group to one worker. pytest-xdist sets that tag
  where pytest 9.2's structured node ids no longer take it (pytest-xdist issue 1386): each
  group's tests went to both workers, and both made the module fixture they share.

  Example: ``grouped(item)`` on a worker; ``item.nodeid`` then ends in ``@layout-runs``.
  """
  marks = item.iter_markers("xdist_group")
  names = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default")) for m in marks})
  tag = "@" + "_".join(names)
  if names and hasattr(item, "_id") and not item.nodeid.endswith(tag):
    item._id = type(item._id).parse(item.nodeid + tag)


def pytest_collection_modifyitems(config, items):
  items[:] = longest_first(items)
  if getattr(config.option, "loadgroup", False):  # A pytest-xdist worker under loadgroup.
    for item in items:
      grouped(item)


def pytest_unconfigure(config):
  del config
  if MADE_CACHE:
    shutil.rmtree(MADE_CACHE, ignore_errors=True)
