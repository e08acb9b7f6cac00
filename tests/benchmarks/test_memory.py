"""The trainer's own plans on the 2-D and pod meshes: optimizer state at most 1.05x the ideal."""

import pytest

from benchmarks import memory


@pytest.mark.parametrize("scan", [False, True])
@pytest.mark.parametrize("config", sorted(memory.TRAINER_CONFIGS))
def test_soap_state_is_at_most_1_05x_the_ideal_on_256_devices(config, scan):
  # SOAP's statistics, eigenbases and rotated Adam moments on Shampoo's tiles, stored as
  # planned: lm_tp_fsdp (data 128 x model 2) and lm_7b_pod (64 x 4), 256 abstract devices.
  # The ideal counts the state as checkpointed (the same on any mesh): the padding of a pool
  # that keeps its state where it runs (lm_7b_pod's, at most 1.05x its tiles) counts against it.
  run = memory.trainer_run(memory.TRAINER_CONFIGS[config], "soap", scan)
  opt = lambda plan: [e for e in plan.entries if e.name.startswith("opt/")]
  held = sum(e.bytes_per_device for e in opt(run.plan))
  ideal = sum(e.nbytes for e in opt(run.stored.plan)) / run.plan.num_devices
  assert held <= 1.05 * ideal, (held / ideal, config, scan)
  assert memory.ideal_ratio(run) <= 1.05
