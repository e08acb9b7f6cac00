"""Writes the small image set big_vision's own ``train.py`` trains on in ``run.sh``.

512 PNG files of 32x32 RGB, 8 classes of 64 images, each class noise around a colour of its
own, and ``train.jsonl`` naming them (``{"image": <absolute path>, "label": <class>}`` a line),
the format of big_vision's ``bv:jsonl`` source. numpy only (no PIL), deterministic (seed 0):

  python tools/big_vision_train/make_data.py OUT_DIR    # writes OUT_DIR/*.png, OUT_DIR/train.jsonl
"""

import json
import pathlib
import struct
import sys
import zlib

import numpy as np

CLASSES, PER_CLASS, SIZE = 8, 64, 32


def png(image: np.ndarray) -> bytes:
  """The bytes of an 8-bit RGB PNG of ``image`` (``(H, W, 3)`` uint8)."""
  height, width, _ = image.shape
  rows = b"".join(b"\x00" + image[y].tobytes() for y in range(height))  # Filter 0 a row.

  def chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

  header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
  return (
      b"\x89PNG\r\n\x1a\n"
      + chunk(b"IHDR", header)
      + chunk(b"IDAT", zlib.compress(rows))
      + chunk(b"IEND", b"")
  )


def write(out: pathlib.Path, seed: int = 0) -> pathlib.Path:
  """Writes the images and ``train.jsonl`` under ``out``; returns the ``.jsonl`` path."""
  rng = np.random.default_rng(seed)
  out.mkdir(parents=True, exist_ok=True)
  colours = rng.uniform(40, 215, size=(CLASSES, 3))
  lines = []
  for label in range(CLASSES):
    for i in range(PER_CLASS):
      noise = rng.normal(0, 40, size=(SIZE, SIZE, 3))
      image = np.clip(colours[label] + noise, 0, 255).astype(np.uint8)
      path = out / f"{label}_{i:03d}.png"
      path.write_bytes(png(image))
      lines.append(json.dumps({"image": str(path.resolve()), "label": label}))
  jsonl = out / "train.jsonl"
  jsonl.write_text("\n".join(lines) + "\n")
  return jsonl


if __name__ == "__main__":
  if len(sys.argv) != 2:
    sys.exit(__doc__)
  print(write(pathlib.Path(sys.argv[1])))
