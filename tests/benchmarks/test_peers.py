"""benchmarks.peers runs each pair on one run: ours set to the peer's math, the peer's state
planned by following the same params."""

import pytest

import bv_sharding as bvs
from benchmarks import peers
from configs import lm
from trainers import build


@pytest.fixture(scope="module")
def config():
  return lm.get_config()


@pytest.mark.parametrize("pair", list(peers.PAIRS))
def test_a_pair_differs_only_in_its_optimizer(config, pair):
  mesh = bvs.make_mesh(config.mesh, axis_types=build.axis_types(config))
  ours = build.build(peers.ours_config(config, pair), mesh)
  peer = peers.peer_run(ours, pair)
  assert ours.config.optax_name == pair.partition("_")[0]
  assert (
      peer.tx is not ours.tx and peer.loss is ours.loss and peer.batch_shapes is ours.batch_shapes
  )
  specs = lambda run: {e.name: e.spec for e in run.plan.entries if e.name.startswith("params/")}
  assert specs(peer) == specs(ours)
  # The peer's state follows the params: no leaf of it is left whole on every device.
  whole = [e.name for e in peer.plan.entries if e.nbytes > 2**16 and e.bytes_per_device == e.nbytes]
  assert whole == []
