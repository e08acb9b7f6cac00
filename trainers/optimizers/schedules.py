"""Learning-rate schedules built from config values."""

from __future__ import annotations

import optax

from trainers.errors import OptimizerError

_DECAYS = ("cosine", "linear", "constant")


def make_schedule(
    peak_value: float,
    total_steps: int,
    *,
    warmup_steps: int = 0,
    decay: str = "cosine",
    end_value: float = 0.0,
) -> optax.Schedule:
  """Linear warmup from 0 to ``peak_value``, then decay to ``end_value``.

  ``decay`` is "cosine", "linear" or "constant" (stays at ``peak_value``);
  it runs over the ``total_steps - warmup_steps`` steps after the warmup.

  Example:
      >>> sched = make_schedule(1.0, 100, warmup_steps=10, decay="linear")
      >>> [float(sched(s)) for s in (0, 5, 10, 55, 100)]
      [0.0, 0.5, 1.0, 0.5, 0.0]
  """
  if decay not in _DECAYS:
    raise OptimizerError(f"decay={decay!r}; expected one of {_DECAYS}")
  decay_steps = max(total_steps - warmup_steps, 1)
  main = {
      "cosine": lambda: optax.cosine_decay_schedule(
          peak_value, decay_steps, alpha=end_value / peak_value if peak_value else 0.0
      ),
      "linear": lambda: optax.linear_schedule(peak_value, end_value, decay_steps),
      "constant": lambda: optax.constant_schedule(peak_value),
  }[decay]()
  if warmup_steps <= 0:
    return main
  warmup = optax.linear_schedule(0.0, peak_value, warmup_steps)
  return optax.join_schedules([warmup, main], [warmup_steps])
