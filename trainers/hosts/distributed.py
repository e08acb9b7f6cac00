"""Starting jax.distributed: from explicit flags, or from the cluster the environment declares.

On TPU pods and slices, SLURM, Open MPI and Kubernetes jobs (the environments
jax's ``jax.distributed.initialize()`` auto-detects), the trainer starts the job
with no flags. The process count the environment declares decides: one process
starts no jax.distributed. Explicit ``--coordinator_address/--num_processes/--process_id``
win; ``--nodistributed_auto`` keeps a run single-host inside such an environment.
Where asking the environment fails (a TPU VM without its metadata server), the run
starts as one process and says why.

Example:
  >>> start(None, 1, 0, auto=True)        # nothing detected: one process
  Started(how='single process', note=None)
"""

import contextlib
import os
import socket
import sys
import textwrap
import threading
from collections.abc import Callable
from typing import NamedTuple

import jax
from jax._src import clusters  # jax has no public API for its cluster detection (0.10).

from trainers.errors import ConfigError

# jax's own deadline comes this much after ours: past it, jax aborts the process (SIGABRT,
# a C++ stack trace), which Python cannot catch.
_GRACE = 10
# What a multi-host job gives by hand; the fallback line and the errors name it.
_BY_HAND = "--coordinator_address, --num_processes and --process_id"


def _tpu_host_count() -> int:
  """Hosts GKE lists for this TPU slice, times its slices; jax's rule with no metadata call."""
  hosts = os.environ.get("TPU_PROCESS_ADDRESSES", os.environ.get("TPU_WORKER_HOSTNAMES", ""))
  return len(hosts.split(",")) * int(os.environ.get("MEGASCALE_NUM_SLICES") or 1)


# The process count each cluster declares in its variables, by jax's cluster name: no network.
_DECLARED_COUNT: dict[str, Callable[[], int]] = {
    "slurm": lambda: int(os.environ["SLURM_NTASKS"]),
    "ompi": lambda: int(os.environ["OMPI_COMM_WORLD_SIZE"]),
    "gketpu": _tpu_host_count,
}


class Started(NamedTuple):
  """How jax.distributed started ("flags", "auto-detected slurm", "single process"), and
  the line to warn with when detection failed (else None).

  Example: ``how, note = start(None, 1, 0, auto=True)``.
  """

  how: str
  note: str | None = None


def simulated_devices() -> int:
  """Devices each process simulates on the CPU backend unless told: ``$BV_DEVICES_PER_PROCESS``,
  else 8 (``trainers.train --devices_per_process``; ``trainers.plan --compile``).

  Example: ``jax.config.update("jax_num_cpu_devices", simulated_devices())``.
  """
  return int(os.environ.get("BV_DEVICES_PER_PROCESS", 8))


def detected() -> tuple[type[clusters.ClusterEnv] | None, int, str | None]:
  """(the cluster jax would detect here or None, the process count it declares, None); or
  (None, 1, the line to warn with) where asking the environment raised.

  The same scan as ``jax.distributed.initialize()`` with no arguments: every known
  environment that is not opt-in only, in jax's order.

  Example: ``detected()[:2] == (clusters.SlurmCluster, 8)`` inside ``srun -n 8``.
  """
  for env in clusters.ClusterEnv._cluster_types:
    if env.opt_in_only_method:
      continue
    try:
      if env.is_env_present():
        return env, _DECLARED_COUNT.get(env.name, env.get_process_count)(), None
    except Exception as error:  # e.g. requests.ConnectionError: no metadata server here.
      return None, 1, fallback_note(env, error)
  return None, 1, None


def fallback_note(env: type[clusters.ClusterEnv], error: Exception) -> str:
  """The line a run that starts as one process after ``env``'s detection raised warns with.

  Example:
    >>> fallback_note(clusters.GceTpuCluster, OSError("no route to host"))  # doctest: +ELLIPSIS
    'gcetpu detection failed (OSError: no route to host); started as one process. For a ...'
  """
  return (
      f"{named(env)} detection failed ({briefly(error)}); started as one "
      f"process. For a multi-host job give {_BY_HAND}; --nodistributed_auto skips detection"
  )


def named(env: type[clusters.ClusterEnv]) -> str:
  """jax's name for the cluster ``env``, else its class name (jax 0.10 names no Kubernetes).

  Example:
    >>> named(clusters.SlurmCluster), named(clusters.K8sCluster)
    ('slurm', 'K8sCluster')
  """
  return env.name or env.__name__


def briefly(error: Exception) -> str:
  """``error``'s type and the start of its first line.

  Example:
    >>> briefly(RuntimeError("no coordinator\\nat line 3"))
    'RuntimeError: no coordinator'
  """
  line = textwrap.shorten(str(error).partition("\n")[0], 120, placeholder=" ...")
  return f"{type(error).__name__}: {line}"


def start(
    coordinator: str | None, num_processes: int, process_id: int, auto: bool, timeout: int = 300
) -> Started:
  """Starts jax.distributed if asked, or if the environment declares more than one process.

  Must run before anything starts the backend. With flags, a coordinator port already in use
  raises ``ConfigError`` naming it. Detected, a coordinator that cannot be read or reached
  raises ``ConfigError``; detection that raises starts one process, with a note saying so.
  A job whose processes have not all connected after ``timeout`` seconds ends this process
  with one line and exit status 1 (:func:`waiting`).

  Example: ``start("10.0.0.1:1234", 2, 0, auto=True) == Started("flags")``.
  """
  if coordinator:
    if process_id == 0:  # The coordinator serves on the port: jax crashes if it is taken.
      check_port_free(coordinator)
    with waiting(f"--coordinator_address={coordinator}", num_processes, process_id, timeout):
      jax.distributed.initialize(
          coordinator, num_processes, process_id, initialization_timeout=timeout + _GRACE
      )
    return Started("flags")
  env, count, note = detected() if auto else (None, 1, None)
  if count == 1:
    return Started("single process", note)
  start_detected(env, count, timeout)
  return Started(f"auto-detected {named(env)}")


def start_detected(env: type[clusters.ClusterEnv], count: int, timeout: int) -> None:
  """Starts jax.distributed as one of the ``count`` processes ``env`` declares.

  Honours ``$JAX_COORDINATOR_ADDRESS`` and ``$JAX_COORDINATOR_PORT`` as jax does; any step
  that raises ends in one ``ConfigError`` naming it (:func:`asking`).

  Example: ``start_detected(clusters.SlurmCluster, 8, 300)`` in each task of ``srun -n 8``.
  """
  port = os.environ.get("JAX_COORDINATOR_PORT")
  address = os.environ.get("JAX_COORDINATOR_ADDRESS") or asking(
      env,
      count,
      "reading its coordinator address",
      lambda: env.get_coordinator_address(timeout, port),
  )
  process_id = asking(env, count, "reading this process's id", env.get_process_id)
  with waiting(f"auto-detected {named(env)}", count, process_id, timeout):
    asking(
        env,
        count,
        f"jax.distributed.initialize at {address}",
        lambda: jax.distributed.initialize(
            address,
            count,
            process_id,
            cluster_detection_method=env.name,  # jax's own local devices for this cluster.
            initialization_timeout=timeout + _GRACE,
        ),
    )


def asking(env: type[clusters.ClusterEnv], count: int, what: str, ask: Callable):
  """``ask()``, or one ``ConfigError`` naming ``env``, ``what`` failed and the flags to give.

  Example:
    >>> asking(clusters.OmpiCluster, 2, "reading its coordinator address", lambda: 1 / 0)
    Traceback (most recent call last):
    ...
    bv_sharding.errors.ConfigError: ompi declares 2 processes; reading its coordinator address failed (ZeroDivisionError: division by zero); give --coordinator_address, ... or --nodistributed_auto for one process
  """
  try:
    return ask()
  except Exception as error:
    raise ConfigError(
        f"{named(env)} declares {count} processes; {what} failed ({briefly(error)}); give "
        f"{_BY_HAND}, or --nodistributed_auto for one process"
    ) from None


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
def waiting(source: str, num_processes: int, process_id: int, timeout: float):
  """Ends this process with one line on stderr and exit status 1 if the block is still
  running after ``timeout`` seconds (jax.distributed waiting for a process that never came).
  ``source`` names where the job came from: a flag, or "auto-detected slurm".

  Example: ``with waiting("auto-detected slurm", 2, 0, 300): jax.distributed.initialize(...)``.
  """
  who = (
      f"process 0 waited for the other {num_processes - 1} (ids 1..{num_processes - 1})"
      if process_id == 0
      else f"process {process_id} waited for the job's other processes"
  )

  def give_up():
    sys.stderr.write(
        f"ConfigError: {source}: {who} of {num_processes} for "
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
