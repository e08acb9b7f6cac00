"""Strategies the optimizer tests plan with (imports only the standard library)."""


def by_dims(specs: dict[str, tuple]) -> list[tuple[str, str]]:
  """Each named param (and the state following it) on its dims: ``shard_dim`` per mesh axis.

  Example:
    >>> by_dims({"w": ("data", None), "b": ()})
    [('(.*/)?w(/.*)?', "shard_dim(axis='data', dim=0)"), ('(.*/)?b(/.*)?', 'replicate()')]
  """
  out = []
  for name, spec in specs.items():
    ops = [f"shard_dim(axis={a!r}, dim={d})" for d, a in enumerate(spec) if a]
    out.append((f"(.*/)?{name}(/.*)?", "|".join(ops) or "replicate()"))
  return out
