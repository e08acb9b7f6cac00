"""Kron's and Shampoo's tiles on any mesh, through `python -m trainers.train`.

With ``blocking="tiles"`` (the default) a param's blocks are its fixed grid of
``block_size`` tiles whatever the mesh, so configs/lm.py trains the same trajectory on 1, 2,
4 and 8 devices and on configs/lm_tp_fsdp.py's 4x2 mesh (float32 losses within 1e-4 of one
device), and a checkpoint saved on 8 devices resumes on 2, 4 and 4x2 with its whole
optimizer state carried over: the resumed losses are the 8-device run's.

Each mesh's run is made once (module fixture); a resumed run compiles the very program of
the run from scratch on its mesh, which the shared compilation cache holds.
"""

import concurrent.futures
import os
import shutil

import pytest

from tests.helpers import metrics, train

STEPS, SAVED = 30, 15
RUN = (
    f"--config.total_steps={STEPS}",
    "--config.batch_size=8",
    "--config.seq_len=32",
    "--config.log_every=1",
    "--config.eval_every=1000",  # Eval only at the last step.
    "--config.eval_batches=1",
    f"--config.ckpt_steps={SAVED}",
    f"--config.keep_ckpt_steps={SAVED}",  # The resumed runs start from step 15's.
    # Constant after 2 warmup steps: the resumed runs' schedule is the uninterrupted one's.
    "--config.schedule.warmup_steps=2",
    "--config.schedule.decay_type=stair",
)
# Mesh -> (config, device count): configs/lm.py's FSDP over "data", lm_tp_fsdp's data x model.
MESHES = {
    "1": ("configs/lm.py", 1),
    "2": ("configs/lm.py", 2),
    "4": ("configs/lm.py", 4),
    "8": ("configs/lm.py", 8),
    "4x2": ("configs/lm_tp_fsdp.py", 8),
}
RESIZED = ("2", "4", "4x2")
OPTIMIZERS = ("kron", "shampoo")


def run(workdir, optimizer: str, mesh: str) -> str:
  """The trainer on ``mesh`` in ``workdir`` (from scratch, or resuming what it holds)."""
  config, devices = MESHES[mesh]
  flags = (f"--config.optax_name={optimizer}", f"--devices_per_process={devices}", *RUN)
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


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """(optimizer, mesh) -> (workdir, output) of the run from scratch, and (optimizer, "8->"
  mesh) -> those of the 8-device run's step-15 checkpoint resumed on ``mesh``."""
  root = tmp_path_factory.mktemp("tiles")
  out = {}
  jobs = [(o, m) for o in OPTIMIZERS for m in MESHES]
  # Two trainers at a time: each spends much of its start single-threaded.
  with concurrent.futures.ThreadPoolExecutor(2) as pool:
    done = {job: pool.submit(run, root / "-".join(job), *job) for job in jobs}
    out.update({job: (root / "-".join(job), f.result()) for job, f in done.items()})
    resumed = {
        (o, f"8->{m}"): resumed_copy(out[o, "8"][0], root / f"{o}-8-to-{m}")
        for o in OPTIMIZERS
        for m in RESIZED
    }
    done = {job: pool.submit(run, path, job[0], job[1][3:]) for job, path in resumed.items()}
    out.update({job: (resumed[job], f.result()) for job, f in done.items()})
  return out


@pytest.mark.timeout(3600)
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_same_trajectory_on_any_mesh(runs, optimizer):
  one = losses(runs[optimizer, "1"][0])
  assert sorted(one) == list(range(1, STEPS + 1)), sorted(one)
  assert one[STEPS] < one[1] - 0.5, one  # It trains.
  for mesh in MESHES:
    got = losses(runs[optimizer, mesh][0])
    worst = max(abs(got[s] - one[s]) for s in one)
    assert worst <= 1e-4, (mesh, worst)
    assert "Involuntary full rematerialization" not in runs[optimizer, mesh][1], mesh


@pytest.mark.timeout(3600)
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_a_resize_keeps_the_optimizer_state(runs, optimizer):
  uninterrupted = losses(runs[optimizer, "8"][0])
  for mesh in RESIZED:
    workdir, out = runs[optimizer, f"8->{mesh}"]
    assert f"resumed at step {SAVED} from" in out, out[-3000:]
    assert "every factor, statistic and moment carried over" in out, out[-3000:]
    assert "re-initialised" not in out
    got = losses(workdir)
    worst = max(abs(got[s] - uninterrupted[s]) for s in range(SAVED + 1, STEPS + 1))
    assert worst <= 1e-4, (mesh, worst)
