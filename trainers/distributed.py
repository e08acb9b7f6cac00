"""Starting jax.distributed: from explicit flags, or from the cluster jax detects.

On TPU pods and slices, SLURM, Open MPI and Kubernetes jobs (the environments
jax's ``jax.distributed.initialize()`` auto-detects), the trainer starts the job
with no flags. Explicit ``--coordinator_address/--num_processes/--process_id``
win; ``--nodistributed_auto`` keeps a run single-host inside such an environment.

Example:
  >>> start(None, 1, 0, auto=True)        # nothing detected: one process
  'single process'
"""

import os

import jax
from jax._src import clusters  # jax has no public API for its cluster detection (0.10).


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


def start(coordinator: str | None, num_processes: int, process_id: int, auto: bool) -> str:
  """Starts jax.distributed if asked or detected; says how ("flags", the cluster, or single).

  Must run before anything starts the backend.

  Example: ``start("10.0.0.1:1234", 2, 0, auto=True) == "flags"``.
  """
  if coordinator:
    jax.distributed.initialize(coordinator, num_processes, process_id)
    return "flags"
  cluster = detected_cluster() if auto else None
  if cluster is None:
    return "single process"
  jax.distributed.initialize()
  return f"auto-detected {cluster}"
