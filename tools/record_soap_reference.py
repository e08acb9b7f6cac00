"""Record the SOAP authors' reference trajectory (nikhilvyas/SOAP, PyTorch).

Runs their ``SOAP`` optimizer for ``STEPS`` steps on a fixed quadratic problem
(``0.5 * sum(h * (p - target)^2)`` over a few 2-D, 3-D and 1-D params, float32; step ``k``'s
gradients ``h * (p - target) + noise[k]`` set by hand) and stores the problem, each run's settings (JSON) and the
params after every step in ``tests/data/soap_reference.npz``;
``tests/optimizers/test_soap.py`` replays the runs with ``bv_sharding.optimizers.soap``.

The reference is not part of the project: it runs once, on CPU, in a scratch venv, from the
authors' ``soap.py`` put in a directory of its own::

    python3 -m venv /tmp/soapref && /tmp/soapref/bin/pip install numpy torch
    git --git-dir=<a clone of nikhilvyas/SOAP>/.git show HEAD:soap.py > /tmp/soapref/soap.py
    /tmp/soapref/bin/python tools/record_soap_reference.py /tmp/soapref

Every factor's statistics are full rank from the first step (square or 3-D tiles, and a
rectangle only its short side rotated): a rank-deficient statistic's null space has no
preferred basis, and Adam in two bases of it differs, so no two implementations agree there.
Each step's gradient has noise of its own: SOAP moves nothing on its first step, so without
it the second step's gradient would be the first's, diagonal in the bases of its own
statistics (its SVD for a square param), and Adam's first step, ``sign(g)`` in the basis,
would take the sign of round-off.
"""

from __future__ import annotations

import json
import pathlib
import sys

import numpy as np

STEPS = 20
OUTPUT = pathlib.Path(__file__).resolve().parents[1] / "tests/data/soap_reference.npz"
SHAPES = {"square": (4, 4), "cube": (2, 3, 6), "wide": (3, 16), "bias": (5,)}
# max_precond_dim 8: "wide"'s 16 is not rotated; with merge_dims "cube" is (6, 6).
RUNS = {
    "default": dict(lr=1e-2, precondition_frequency=3, max_precond_dim=8, weight_decay=0.0),
    "decay_normalized": dict(
        lr=1e-2,
        betas=[0.9, 0.99],
        shampoo_beta=0.9,
        precondition_frequency=2,
        max_precond_dim=8,
        weight_decay=0.1,
        normalize_grads=True,
    ),
    "merged": dict(lr=2e-2, precondition_frequency=4, max_precond_dim=8, merge_dims=True),
}


def problem(seed: int = 0) -> dict[str, dict[str, np.ndarray]]:
  """The params' start, ``h``, ``target`` and each step's ``noise``, float32, by param name."""
  rng = np.random.default_rng(seed)
  out = {"init": {}, "h": {}, "target": {}, "noise": {}}
  for name, shape in SHAPES.items():
    out["init"][name] = rng.standard_normal(shape).astype(np.float32)
    out["h"][name] = rng.uniform(0.5, 2.0, shape).astype(np.float32)
    out["target"][name] = rng.standard_normal(shape).astype(np.float32)
    out["noise"][name] = 0.3 * rng.standard_normal((STEPS, *shape)).astype(np.float32)
  return out


def trajectory(soap_class, settings: dict, data: dict) -> dict[str, np.ndarray]:
  """The params after each of ``STEPS`` steps of the reference, ``(STEPS, *shape)`` each."""
  import torch

  params = {n: torch.nn.Parameter(torch.tensor(x)) for n, x in data["init"].items()}
  kwargs = dict(settings)
  if "betas" in kwargs:
    kwargs["betas"] = tuple(kwargs["betas"])
  opt = soap_class(list(params.values()), **kwargs)
  steps = {n: [] for n in params}
  for k in range(STEPS):
    for n, p in params.items():
      h, target = torch.tensor(data["h"][n]), torch.tensor(data["target"][n])
      p.grad = (h * (p.detach() - target) + torch.tensor(data["noise"][n][k])).clone()
    opt.step()
    for n, p in params.items():
      steps[n].append(p.detach().numpy().copy())
  return {n: np.stack(s) for n, s in steps.items()}


def main(reference_dir: str) -> None:
  sys.path.insert(0, reference_dir)
  import torch
  from soap import SOAP  # The authors' soap.py, outside the project.

  torch.manual_seed(0)
  data = problem()
  arrays = {f"{k}/{n}": x for k, xs in data.items() for n, x in xs.items()}
  for run, settings in RUNS.items():
    for n, x in trajectory(SOAP, settings, data).items():
      arrays[f"{run}/{n}"] = x
  arrays["runs"] = np.array(json.dumps(RUNS))
  arrays["versions"] = np.array(json.dumps({"torch": torch.__version__, "numpy": np.__version__}))
  np.savez(OUTPUT, **arrays)
  print(f"wrote {OUTPUT} ({len(RUNS)} runs of {STEPS} steps)")


if __name__ == "__main__":
  main(sys.argv[1])
