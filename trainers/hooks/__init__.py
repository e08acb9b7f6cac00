"""What the loop runs beside its steps: metrics, preemption, non-finite losses.

Metrics are the log lines, metrics.jsonl and TensorBoard; preemption saves and stops on
SIGTERM; the non-finite loss policy stops or skips a step whose loss is not finite.
"""
