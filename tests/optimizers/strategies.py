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


# A ViT's ranks, tiny: 2-D, 3-D (attention kernel), 4-D (conv embedding), a scanned stack, a
# bias. On 8 devices (4 x 2) "dense" is shard-local 8-tiles, the others' tiles span shards
# (dealt to owners, or pooled over the mesh); on 4 (2 x 2) and 2 (1 x 2) fewer span.
VIT_SHAPES = {
    "dense": (32, 16),
    "attn": (16, 4, 8),
    "conv": (2, 2, 8, 16),
    "stack": (2, 16, 8),
    "bias": (16,),
}
VIT_SPECS = {
    "dense": ("data", "model"),
    "attn": (None, "model", "data"),
    "conv": (None, None, "data", "model"),
    "stack": (None, "data", "model"),
    "bias": (),
}


# Tiny params on a data x model mesh, for 8-tiles: shard-local tiles, tiles spanning shards
# (dealt to owners or pooled over the mesh), a stack of layers, a never-sharded matrix, a vector.
TINY_SHAPES = {
    "dense": (32, 16),
    "attn": (16, 4, 8),
    "stack": (2, 16, 8),
    "norm": (8, 8),
    "bias": (16,),
}
TINY_SPECS = {
    "dense": ("data", "model"),
    "attn": (None, "model", "data"),
    "stack": (None, "data", "model"),
    "norm": (),
    "bias": (),
}
