"""Starting jax.distributed: from explicit flags, or from the cluster jax detects.

On TPU pods and slices, SLURM, Open MPI and Kubernetes jobs (the environments
jax's ``jax.distributed.initialize()`` auto-detects), the trainer starts the job
with no flags. Explicit ``--coordinator_address/--num_processes/--process_id``
win; ``--nodistributed_auto`` keeps a run single-host inside such an environment.

Example:
  >>> start(None, 1, 0, auto=True)        # nothing detected: one process
  'single process'
"""

import contextlib
import os
import socket
import sys
import threading

import jax
from jax._src import clusters  # jax has no public API for its cluster detection (0.10).

from trainers.errors import ConfigError

# jax's own deadline comes this much after ours: past it, jax aborts the process (SIGABRT,
# a C++ stack trace), which Python cannot catch.
_GRACE = 10


def simulated_devices() -> int:
  """Devices each process simulates on the CPU backend unless told: ``$BV_DEVICES_PER_PROCESS``,
  else 8 (``trainers.train --devices_per_process``; ``trainers.plan --compile``).

  Example: ``jax.config.update("jax_num_cpu_devices", simulated_devices())``.
  """
  return int(os.environ.get("BV_DEVICES_PER_PROCESS", 8))


def detected_cluster() -> str | None:
  """The name of the cluster environment jax would auto-detect here (e.g. "slurm"), or None.

  The same scan as ``jax.distributed.initialize()`` with no arguments: every known
  environment that is not opt-in only, in jax's order.

  Example: ``detected_cluster() == "slurm"`` inside ``srun``.
  """
  found = next(
      (
          env
          for env in clusters.ClusterEnv._cluster_types
          if not env.opt_in_only_method and env.is_env_present()
      ),
      None,
  )
  return found.name if found else None


def start(
    coordinator: str | None, num_processes: int, process_id: int, auto: bool, timeout: int = 300
) -> str:
  """Starts jax.distributed if asked or detected; says how ("flags", the cluster, or single).

  Must run before anything starts the backend. With flags, a coordinator port already in use
  raises ``ConfigError`` naming it, and a job whose processes have not all connected after
  ``timeout`` seconds ends this process with one line and exit status 1 (:func:`waiting`).

  Example: ``start("10.0.0.1:1234", 2, 0, auto=True) == "flags"``.
  """
  if coordinator:
    if process_id == 0:  # The coordinator serves on the port: jax crashes if it is taken.
      check_port_free(coordinator)
    with waiting(coordinator, num_processes, process_id, timeout):
      jax.distributed.initialize(
          coordinator, num_processes, process_id, initialization_timeout=timeout + _GRACE
      )
    return "flags"
  cluster = detected_cluster() if auto else None
  if cluster is None:
    return "single process"
  jax.distributed.initialize()
  return f"auto-detected {cluster}"


def check_port_free(coordinator: str) -> None:
  """Raises ``ConfigError`` if this host cannot serve on ``coordinator``'s port (``host:port``).

  Example:
    >>> with socket.socket() as taken:
    ...   taken.bind(("127.0.0.1", 0)); taken.listen()
    ...   check_port_free(f"127.0.0.1:{taken.getsockname()[1]}")
    Traceback (most recent call last):
    ...
    bv_sharding.errors.ConfigError: --coordinator_address=127.0.0.1:...: port ... is in use on this host; give the job a free port (trainers.launch picks one)
  """
  port = int(coordinator.rsplit(":", 1)[1])
  with socket.socket() as probe:
    try:
      probe.bind(("", port))
    except OSError:
      raise ConfigError(
          f"--coordinator_address={coordinator}: port {port} is in use on this host; give the "
          "job a free port (trainers.launch picks one)"
      ) from None


@contextlib.contextmanager
def waiting(coordinator: str, num_processes: int, process_id: int, timeout: float):
  """Ends this process with one line on stderr and exit status 1 if the block is still
  running after ``timeout`` seconds (jax.distributed waiting for a process that never came).

  Example: ``with waiting("127.0.0.1:1234", 2, 0, 300): jax.distributed.initialize(...)``.
  """
  who = (
      f"process 0 waited for the other {num_processes - 1} (ids 1..{num_processes - 1})"
      if process_id == 0
      else f"process {process_id} waited for the job's other processes"
  )

  def give_up():
    sys.stderr.write(
        f"ConfigError: --coordinator_address={coordinator}: {who} of {num_processes} for "
        f"{timeout:g} s; start every process with the same address, or raise "
        "--distributed_timeout\n"
    )
    sys.stderr.flush()
    os._exit(1)

  timer = threading.Timer(timeout, give_up)
  timer.daemon = True
  timer.start()
  try:
    yield
  finally:
    timer.cancel()
