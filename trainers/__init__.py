"""A big_vision-style trainer built on ``bv_sharding``: commands on top, library below.

Commands (``python -m trainers.<name>``): ``train``, ``plan`` (a run's plan without
devices), ``launch`` (several ``jax.distributed`` processes on one host), ``convert``
(documents to token files) and ``sample`` (text from a run's checkpoint). Each builds its run through :mod:`trainers.build`. Below them:

  build, start, steps, loop      the run built once, where it starts, the jitted steps, the loop
  errors, precision              one-line errors; the dtypes a config asks for
  settings/                      flags, config loading and the checks before a run
  hooks/                         what the loop runs beside its steps: metrics, preemption, the
                                 non-finite loss policy
  figures/                       a step's FLOPs, memory per device and MFU
  hosts/                         jax.distributed start-up; one job on every host
  input/                         sources, deterministic batches, prefetch, tasks
  models/, optimizers/           Llama and ViT; the optimizer registry, Kron, Shampoo, Muon
  rundir/                        workdir files, provenance, orbax checkpoints

Every entry point gives OpenBLAS one thread before numpy loads it: its threads fight
XLA's for the cores of small hosts and make each small triangular solve ~1000x slower.
Processes they start inherit the setting through the environment::

  import os
  from trainers import ONE_BLAS_THREAD
  os.environ.setdefault(*ONE_BLAS_THREAD)

Sizes the commands and benchmarks print are in ``MiB``.

Example:
  >>> ONE_BLAS_THREAD
  ('OPENBLAS_NUM_THREADS', '1')
  >>> 3 * MiB
  3145728
"""

ONE_BLAS_THREAD = ("OPENBLAS_NUM_THREADS", "1")
MiB = 2**20
