"""What the loop runs beside its steps, each on its own: metrics (log lines, metrics.jsonl,
TensorBoard), preemption (SIGTERM: save and stop) and the non-finite loss policy."""
