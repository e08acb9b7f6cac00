"""Where batches come from: sources, batching, prefetch, tasks and token records."""
