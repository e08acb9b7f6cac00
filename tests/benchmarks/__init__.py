"""The benchmarks measure what the trainer runs."""
