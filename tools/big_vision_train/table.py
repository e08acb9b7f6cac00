"""Prints the training-loss table of a ``run.sh`` output folder, as docs/big_vision.md shows it.

  python tools/big_vision_train/table.py OUT_DIR [adam kron shampoo muon]

Reads big_vision's own ``big_vision_metrics.txt`` of each run (``OUT_DIR/<opt>/d8``, ``d4``,
``d2``): ``training_loss`` at steps 5/10/15/20 on 8 devices and 25/30/35/40 for each resume,
and the first step each resume logged (21 when it went on from the step-20 checkpoint).
Exits 1 when a run lacks a step.
"""

import json
import pathlib
import sys

FIRST, RESUMED = (5, 10, 15, 20), (25, 30, 35, 40)


def losses(workdir: pathlib.Path) -> dict[int, float]:
  """``{step: training_loss}`` of a big_vision workdir (the last line of a step wins)."""
  found = {}
  path = workdir / "big_vision_metrics.txt"
  for line in path.read_text().splitlines() if path.exists() else []:
    row = json.loads(line)
    if "training_loss" in row:
      found[row["step"]] = row["training_loss"]
  return found


def row(out: pathlib.Path, name: str) -> tuple[str, bool]:
  """The table row of optimizer ``name`` and whether every step is there."""
  cells, complete = [name], True
  for devices, steps in (("d8", FIRST), ("d4", RESUMED), ("d2", RESUMED)):
    found = losses(out / name / devices)
    complete &= all(s in found for s in steps)
    cell = " / ".join(f"{found[s]:.3f}" if s in found else "-" for s in steps)
    if devices != "d8":
      first = min((s for s in found if s > 20), default=None)
      cell += f" (first step {first})"
    cells.append(cell)
  return "| " + " | ".join(cells) + " |", complete


def main(argv: list[str]) -> int:
  out, names = pathlib.Path(argv[0]), argv[1:] or ["adam", "kron", "shampoo", "muon"]
  print("| optimizer | 8 devices, step 5 / 10 / 15 / 20 | on 4, 25 / 30 / 35 / 40 | on 2, same |")
  print("|---|---|---|---|")
  ok = True
  for name in names:
    line, complete = row(out, name)
    print(line)
    ok &= complete
  return 0 if ok else 1


if __name__ == "__main__":
  if len(sys.argv) < 2:
    sys.exit(__doc__)
  sys.exit(main(sys.argv[1:]))
