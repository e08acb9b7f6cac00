"""One command per measurement (``python -m benchmarks.<name>``), each printing a table."""
