"""The trainer's real train step with shard-local Kron/Shampoo and owner-computed Muon on a 2-D
mesh (8 simulated devices): XLA compiles it without "Involuntary full rematerialization" and it
moves about what adamw moves (Muon: at most twice, one all-to-all of the momentum to the owners
and an all-gather of the update)."""

import pytest

from benchmarks import step_traffic
from bv_sharding import traffic


@pytest.fixture(scope="module")
def adamw_bytes():
  hlo, _, _, _ = step_traffic.compile_step(step_traffic.load_config("lm_tp_fsdp"), "adamw")
  return traffic.wire_bytes(hlo)


# Shampoo's statistics of the never-sharded norm scales (d x d each) are sharded by the
# fallback for memory, so their eigh gathers them: a few percent over Kron's step.
BOUND = {"kron": 1.10, "shampoo": 1.20, "muon": 2.0}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("optimizer", list(BOUND))
def test_second_order_step_compiles_without_remat_and_near_adamw_traffic(optimizer, adamw_bytes):
  hlo, log, _, _ = step_traffic.compile_step(step_traffic.load_config("lm_tp_fsdp"), optimizer)
  assert step_traffic.REMAT not in log
  assert traffic.wire_bytes(hlo) <= BOUND[optimizer] * adamw_bytes
