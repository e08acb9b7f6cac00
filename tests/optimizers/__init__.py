"""The library's optimizers: math, tiles on any mesh, state dtypes, migration."""
