"""`python -m trainers.train` on data written here: token files, a text directory, .npy images.

Each run is the command a user types (configs/lm_data.py, configs/vit_images.py),
a few steps of a tiny model; the loss must fall. A bad input fails before init.
"""

import numpy as np
import pytest

from tests.e2e.test_train import SHORT, train


def learnable_tokens(n, vocab=512, period=97, seed=0):
  """A cycle of `period` distinct ids < vocab, repeated: each id predicts the next."""
  cycle = np.random.default_rng(seed).permutation(vocab)[:period].astype(np.uint16)
  return np.resize(cycle, n)


def labelled_images(n, seed=0):
  """8x8x1 uint8 images whose class (0-3) is the bright quadrant, with noise."""
  rng = np.random.default_rng(seed)
  labels = rng.integers(0, 4, n)
  images = rng.integers(0, 60, (n, 8, 8, 1)).astype(np.uint8)
  for k in range(4):
    rows, cols = divmod(k, 2)
    images[labels == k, 4 * rows : 4 * rows + 4, 4 * cols : 4 * cols + 4] += 180
  return images, labels


def write_data(root):
  """The three inputs; returns the config argument for each."""
  tokens = root / "tokens"
  tokens.mkdir()
  learnable_tokens(40_000).tofile(tokens / "train.bin")
  learnable_tokens(4_000, seed=0).tofile(tokens / "val.bin")
  text = root / "text" / "nested"
  text.mkdir(parents=True)
  for i in range(3):
    (text / f"{i}.txt").write_text("The quick brown fox jumps over the lazy dog. " * 300)
  for split, n in (("train", 2_000), ("val", 256)):
    (root / "images" / split).mkdir(parents=True)
    images, labels = labelled_images(n, seed=len(split))
    np.save(root / "images" / split / "images.npy", images)
    np.save(root / "images" / split / "labels.npy", labels)
  return {
      "tokens": (
          f"configs/lm_data.py:train={tokens}/train.bin,val={tokens}/val.bin,vocab=512",
          "tokens/s=",
      ),
      "text": (f"configs/lm_data.py:kind=text,train={root}/text", "tokens/s="),
      "images": (
          f"configs/vit_images.py:train={root}/images/train,val={root}/images/val,classes=4",
          "images/s=",
      ),
  }


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
  return write_data(tmp_path_factory.mktemp("own_data"))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", ["tokens", "text", "images"])
def test_training_on_own_data_lowers_the_loss(tmp_path, inputs, kind):
  config, unit = inputs[kind]
  # The ViT config has no seq_len and sets its warmup as a percent of total_steps.
  overrides = (
      SHORT if kind != "images" else [s for s in SHORT if "seq_len" not in s and "warmup" not in s]
  )
  status, out, records = train(tmp_path, *overrides, config=config)
  assert status == 0, out[-3000:]
  assert [r["step"] for r in records] == [1, 10, 20, 30]
  assert records[-1]["loss"] < 0.8 * records[0]["loss"], records
  assert "eval_loss" in records[-1] and unit in out


@pytest.mark.timeout(120)
def test_bad_input_fails_before_init(tmp_path, inputs):
  tokens_config, _ = inputs["tokens"]
  status, out, records = train(
      tmp_path, *SHORT, config=tokens_config.replace("vocab=512", "vocab=256")
  )
  assert status != 0
  assert "train.bin holds token id 503" in out and "set config.model.vocab_size=" in out, out[
      -3000:
  ]
  assert "ConfigError" in out and "initialising params" not in out and records == []
