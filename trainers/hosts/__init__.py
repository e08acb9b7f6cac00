"""Many processes as one job: jax.distributed start-up, the same job on every host."""
