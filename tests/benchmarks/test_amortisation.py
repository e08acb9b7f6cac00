"""benchmarks.amortisation reads the update's and the forward and backward pass's costs from
the compiled programs: the pass's grow with the batch, the update's do not."""

import pytest

from benchmarks import amortisation


@pytest.mark.timeout(600)
def test_the_pass_grows_with_the_batch_and_a_second_order_update_outweighs_adamws():
  base = amortisation.built("lm", "adamw")
  adamw = amortisation.update_cost(base)
  zero, slope = amortisation.model_cost("lm", base, adamw)
  tokens = base.config.seq_len
  assert tokens == 128  # configs/lm.py's seq_len: tokens per batch row.
  # Every FLOP of a forward and backward pass is some token's: less than one row's at batch 0.
  assert 0 < zero.flops < slope.flops
  # The params and their grads are read whatever the batch: bytes at batch 0 are most of them.
  assert zero.bytes > slope.bytes
  kron = amortisation.update_cost(amortisation.built("lm", "kron"))
  assert kron.flops > 100 * adamw.flops > 0
  # At the config's batch (32 rows) Kron's update is 0.42 of the pass's FLOPs; at a million
  # tokens a step, 0.0016.
  production = zero.at(slope, 2**20 / tokens)
  assert kron.flops / production.flops < 0.01 < 0.1 < kron.flops / zero.at(slope, 32).flops
