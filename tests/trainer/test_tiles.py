"""Kron's, Shampoo's and SOAP's tiles on any mesh, through `python -m trainers.train`.

With ``blocking="tiles"`` (the default) a param's blocks are its fixed grid of
``block_size`` tiles whatever the mesh, so configs/lm.py trains the same trajectory on 1, 2,
4 and 8 devices and on configs/lm_tp_fsdp.py's 4x2 mesh (float32 losses within 1e-4 of one
device), and a checkpoint saved on 8
devices resumes on 2, 4 and 4x2 with its whole optimizer state carried over: the resumed
losses are the 8-device run's.

The configs' tiny Llama has one layer here instead of two (the configs' ``layers=1``): every
kind of tile the two layers have, in half the compile. Kron's 256-tiles: on 2 devices the
MLP kernels' (two per kernel) dealt to owners and the other matrices' pooled, on 4, 8 and
4x2 all pooled; Shampoo's blocks (and SOAP's, the same tiles) pooled on every mesh of more
than one device.

Each mesh's run is made once; a resumed run compiles the very program of the run from
scratch on its mesh, which the shared compilation cache holds.
"""

import concurrent.futures
import os
import shutil

import pytest

from tests.helpers import metrics, train

# Shampoo preconditions from step 10 (its registry default) and SOAP refreshes its bases every
# 10 steps: the resumed steps 16-30 are preconditioned from the statistics the checkpoint
# carried, and SOAP's cross two refreshes.
STEPS, SAVED = 30, 15
RUN = (
    f"--config.total_steps={STEPS}",
    "--config.batch_size=8",
    "--config.seq_len=32",
    "--config.log_every=1",
    "--config.eval_every=1000",  # Eval only at the last step.
    "--config.eval_batches=1",
    f"--config.ckpt_steps={SAVED}",
    f"--config.keep_ckpt_steps={SAVED}",  # The resumed runs start from step SAVED's.
    # Constant after 2 warmup steps: the resumed runs' schedule is the uninterrupted one's.
    "--config.schedule.warmup_steps=2",
    "--config.schedule.decay_type=stair",
)
# Mesh -> (config, device count): configs/lm.py's FSDP over "data", lm_tp_fsdp's data x model.
MESHES = {
    "1": ("lm", 1),
    "2": ("lm", 2),
    "4": ("lm", 4),
    "8": ("lm", 8),
    "4x2": ("lm_tp_fsdp", 8),
}
RESIZED = ("2", "4", "4x2")
OPTIMIZERS = ("kron", "shampoo", "soap")
# SOAP's bases follow its statistics continuously (power_damping, the registry's; the reference's
# eigh and sorted QR turn them freely among nearly equal eigenvalues: runs from scratch part
# from one device's by 0.04-0.11 over 30 steps), and relative_eps bounds what Adam's
# normalisation of the smallest rotated coordinates makes of the rounding left: with both, the
# runs from scratch stay within 1.2e-5 of one device's on 2, 4, 8 and 4x2 (8.4e-5 at most over
# seeds 0-3; power_damping alone 1.4e-4; the canonical eigh bases of an earlier basis_tol=1e-2
# 3.8e-4 at seed 0 and 1e-2 to 5e-2 at seeds 1 and 2; 2026-12-07). Every pool of Kron's and SOAP's keeps its state where it runs
# (resident_padding, the registry's 1.5 holds fewer here): their checkpoints hold that state
# given back to the params (trainers/stored.py), and a run on another mesh holds it in that
# mesh's pools.
FLAGS = {
    "kron": ("--config.optax.resident_padding=64",),
    "soap": (
        "--config.optax.relative_eps=0.001",
        "--config.optax.resident_padding=64",
    ),
}


def run(workdir, optimizer: str, mesh: str) -> str:
  """The trainer on ``mesh`` in ``workdir`` (from scratch, or resuming what it holds)."""
  name, devices = MESHES[mesh]
  config = f"configs/{name}.py:layers=1"
  flags = (f"--config.optax_name={optimizer}", f"--devices_per_process={devices}", *RUN)
  flags += FLAGS.get(optimizer, ())
  status, out, _ = train(workdir, *flags, config=config, timeout=900)
  assert status == 0, out[-4000:]
  return out


def losses(workdir) -> dict[int, float]:
  """Step -> training loss; a resumed run's records replace those of the steps it re-ran."""
  return {r["step"]: r["loss"] for r in metrics(workdir) if "loss" in r}


def resumed_copy(workdir, target):
  """A copy of ``workdir`` holding only its checkpoint at step ``SAVED``."""
  shutil.copytree(workdir, target)
  for name in os.listdir(target / "checkpoints"):
    if name.isdigit() and int(name) != SAVED:
      shutil.rmtree(target / "checkpoints" / name)
  return target


def runs_of(root, optimizer: str) -> dict:
  """mesh -> (workdir, output) of ``optimizer``'s run from scratch, and "8->" mesh -> those
  of the 8-device run's step-``SAVED`` checkpoint resumed on ``mesh``."""
  out = {}
  # Two trainers at a time: each spends much of its start single-threaded.
  with concurrent.futures.ThreadPoolExecutor(2) as pool:
    done = {mesh: pool.submit(run, root / mesh, optimizer, mesh) for mesh in MESHES}
    out.update({mesh: (root / mesh, f.result()) for mesh, f in done.items()})
    resumed = {m: resumed_copy(out["8"][0], root / f"8-to-{m}") for m in RESIZED}
    done = {m: pool.submit(run, path, optimizer, m) for m, path in resumed.items()}
    out.update({f"8->{m}": (resumed[m], f.result()) for m, f in done.items()})
  return out


# One test per optimizer, so that its runs are made once (pytest-xdist gives each worker its
# own module fixtures) and the optimizers' runs are spread over the two workers.
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_same_trajectory_on_any_mesh_and_a_resize_keeps_the_state(tmp_path, optimizer):
  runs = runs_of(tmp_path, optimizer)
  one = losses(runs["1"][0])
  assert sorted(one) == list(range(1, STEPS + 1)), sorted(one)
  assert one[STEPS] < one[1] - 0.5, one  # It trains.
  for mesh in MESHES:
    got = losses(runs[mesh][0])
    worst = max(abs(got[s] - one[s]) for s in one)
    assert worst <= 1e-4, (mesh, worst)
    assert "Involuntary full rematerialization" not in runs[mesh][1], mesh
  # The 8-device checkpoint at step SAVED, resumed on 2, 4 and 4x2 devices.
  uninterrupted = losses(runs["8"][0])
  for mesh in RESIZED:
    workdir, out = runs[f"8->{mesh}"]
    assert f"resumed at step {SAVED} from" in out, out[-3000:]
    assert "every factor, statistic and moment carried over" in out, out[-3000:]
    assert "re-initialised" not in out
    got = losses(workdir)
    error = {s: abs(got[s] - uninterrupted[s]) for s in range(SAVED + 1, STEPS + 1)}
    assert max(error.values()) <= 1e-4, (mesh, error)
