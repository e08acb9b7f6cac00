"""Every test process sees 8 simulated CPU devices.

OpenBLAS (behind JAX's CPU linear algebra) gets one thread: its threads fight
XLA's on small hosts and make each small triangular solve ~1000x slower.
"""

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import jax

jax.config.update("jax_num_cpu_devices", 8)
