"""One setting every entry point applies to its process before numpy loads OpenBLAS.

OpenBLAS (behind numpy and JAX's CPU linear algebra) starts a thread per core; on
small hosts those threads fight XLA's for the cores and make each small triangular
solve ~1000x slower. Entry points (``trainers.train``, the benchmarks, the tests'
``conftest.py``) give it one thread unless the environment already says otherwise:

  import os
  from trainers.host import ONE_BLAS_THREAD
  os.environ.setdefault(*ONE_BLAS_THREAD)

Processes they start inherit the setting through the environment.

Example:
  >>> ONE_BLAS_THREAD
  ('OPENBLAS_NUM_THREADS', '1')
"""

ONE_BLAS_THREAD = ("OPENBLAS_NUM_THREADS", "1")
