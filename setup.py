"""bv_sharding: sharding plans for params and optimizer state in big_vision-style JAX training."""

import setuptools

STYLE = ["pyink==26.5.1", "ruff==0.17.6"]  # The house style (pyproject.toml), checked in CI.
PLOT = ["matplotlib>=3.8,<4"]
PARQUET = ["pyarrow>=26.0.1,<27"]  # trainers.convert reads .parquet corpora.
TEST = [
    "pytest>=8,<10",
    "pytest-timeout>=2.3,<3",
    "pytest-xdist==3.8.0",  # pytest.ini runs two workers.
    "filelock>=3.12,<5",  # jax's lock around the shared compilation cache (tests/conftest.py).
    "scikit-learn>=1.4,<2",
    "chex>=0.1.87,<0.2",
    # Third-party optimizer states the tests and benchmarks plan (benchmarks/zoo.py, with the
    # aliases of benchmarks/compat.py).
    "psgd-jax==0.2.9",
    "precondition-opt==0.3.0",
    *PLOT,
    *PARQUET,
    *STYLE,
]
# gs:// workdirs (trainers/rundir/paths.py): epath's GCS backend, and Google's client.
GCS = ["gcsfs==2026.10.1", "google-cloud-storage>=3.4,<4"]
# The tests' bucket: a pure-Python GCS emulator on 127.0.0.1 (tests/trainer/test_workdir_bucket.py).
TEST += [*GCS, "gcp-storage-emulator==2026.7.19"]

setuptools.setup(
    name="bv_sharding",
    version="0.1.0",
    description="Config-driven sharding plans for Flax params and any optax optimizer state.",
    packages=setuptools.find_packages(include=["bv_sharding*", "trainers*", "configs*"]),
    python_requires=">=3.11,<3.13",
    install_requires=[
        "jax>=0.10.2,<0.11",
        "flax>=0.12.8,<0.13",
        "optax>=0.2.8,<0.3",
        "numpy>=1.26,<3",
        "ml_collections>=1.0,<2",
        "absl-py>=2.0,<3",
        "regex>=2024.4",  # Strategy regexes matched with a time bound (bv_sharding/patterns.py).
        "orbax-checkpoint==0.12.8",  # Checkpoints (trainers/rundir/checkpoint.py); its API moves fast.
        # TensorBoard event files (trainers/rundir/events.py) without TensorFlow; pinned like orbax.
        "tensorboardX==2.6.5",
        # Tokenizers (trainers/input/tokenizer.py): tokenizer.json files, BPE training.
        "tokenizers==0.23.3",
    ],
    extras_require={
        "vision": ["scikit-learn>=1.4,<2"],
        "plot": PLOT,  # trainers.plan --png
        "gcs": GCS,  # --workdir gs://bucket/run
        "parquet": PARQUET,  # trainers.convert on .parquet files
        # One TPU VM: jax with libtpu, at the pinned version (a plain install brings the CPU jax).
        "tpu": ["jax[tpu]>=0.10.2,<0.11"],
        "test": TEST,
        "dev": TEST,  # The tests, the formatter and the linter.
    },
)
