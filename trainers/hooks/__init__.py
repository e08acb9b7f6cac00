"""What the loop runs beside its steps, each on its own: the non-finite loss policy."""
