"""Many processes as one job: ``jax.distributed`` start-up and the check that every host runs the same job."""
