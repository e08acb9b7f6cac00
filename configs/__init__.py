"""big_vision-style ``get_config(arg)`` files: a run's whole description as code."""
