"""Every test process sees 8 simulated CPU devices and gives OpenBLAS one thread.

OpenBLAS threads fight XLA's on small hosts (``trainers/__init__.py`` says why); the
setting reaches the subprocesses tests start through the environment.
"""

import os

from trainers import ONE_BLAS_THREAD

os.environ.setdefault(*ONE_BLAS_THREAD)

import jax

jax.config.update("jax_num_cpu_devices", 8)
