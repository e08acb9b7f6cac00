"""Logical axis names of the models' activations; ``config.sharding_rules`` maps them to mesh axes.

Each tuple names the dims of one activation for ``nn.with_logical_constraint``; outside
an ``nn.logical_axis_rules`` context the constraints are no-ops. ``ACT_BATCH`` is also the
rule the trainer splits its batches by (``trainers.steps.data_axes``).

Example:
  >>> import flax.linen as nn
  >>> with nn.logical_axis_rules([("act_batch", "data"), ("act_heads", "model")]):
  ...   nn.logical_to_mesh_axes(ACT_HEADS)
  P('data', None, 'model', None)
"""

ACT_BATCH = "act_batch"
ACT_EMBED = (ACT_BATCH, "act_len", "act_embed")  # The token stream: (batch, length, width).
ACT_HEADS = (ACT_BATCH, "act_len", "act_heads", None)  # (batch, length, heads, head_dim).
ACT_MLP = (ACT_BATCH, "act_len", "act_mlp")  # The MLP's hidden units.
ACT_VOCAB = (ACT_BATCH, "act_len", "act_vocab")  # Logits.
