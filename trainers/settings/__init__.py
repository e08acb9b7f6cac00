"""A run's settings: the command line and config file read (``cli``) and checked (``validation``)."""
