"""Prints the training-loss table of a ``run.sh`` output folder, as docs/big_vision.md shows it.

  python tools/big_vision_train/table.py OUT_DIR [adam kron shampoo muon soap]

Reads the ``training_loss`` big_vision logs (``[STEP] training_loss = VALUE``) in each run's
log (``OUT_DIR/<opt>/d8.log``, ``d4.log``, ``d2.log``): steps 5/10/15/20 on 8 devices and
25/30/35/40 for each resume, with the first step each resume ran (21 when it went on from the
step-20 checkpoint). The log, not ``big_vision_metrics.txt``: big_vision writes that file's
rows on a thread that reads the step when it writes, so a row can carry the next step's number.
Exits 1 when a run lacks a step.
"""

import pathlib
import re
import sys

FIRST, RESUMED = (5, 10, 15, 20), (25, 30, 35, 40)
LINE = re.compile(r"\[(\d+)\]\x1b\[0m training_loss = (\S+)")


def losses(log: pathlib.Path) -> dict[int, float]:
  """``{step: training_loss}`` logged in ``log`` (empty when it is missing)."""
  text = log.read_text(errors="replace") if log.exists() else ""
  return {int(step): float(value) for step, value in LINE.findall(text)}


def row(out: pathlib.Path, name: str) -> tuple[str, bool]:
  """The table row of optimizer ``name`` and whether every step is there."""
  cells, complete = [name], True
  for devices, steps in (("d8", FIRST), ("d4", RESUMED), ("d2", RESUMED)):
    found = losses(out / name / f"{devices}.log")
    complete &= all(s in found for s in steps)
    cell = " / ".join(f"{found[s]:.3f}" if s in found else "-" for s in steps)
    if devices != "d8":
      cell += f" (from step {min(found, default=None)})"
    cells.append(cell)
  return "| " + " | ".join(cells) + " |", complete


def main(argv: list[str]) -> int:
  out, names = pathlib.Path(argv[0]), argv[1:] or ["adam", "kron", "shampoo", "muon", "soap"]
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
