"""trainers/input/sources.py: token files, text corpora and .npy images on disk.

Every file here is written by the test; windows are compared with the same
tokens held in memory, and every kind of bad input must raise a ConfigError
naming the file and the fix, before a model exists.
"""

import json
import logging

import ml_collections
import numpy as np
import pytest

from trainers import models
from trainers.errors import ConfigError
from trainers.input import batching, sources, tasks

TOKENS = (np.arange(30_000) * 7 % 1000).astype(np.uint16)  # ids < 1000, no two windows alike
HELD = (np.arange(10_000) % 251).astype(np.uint8)
IMAGES = {
    "image": np.arange(50 * 4, dtype=np.float32).reshape(50, 2, 2, 1),
    "label": np.arange(50, dtype=np.int32),
}


def spec(**overrides):
  return sources.input_spec(sources.input_config(**overrides))


def task(seq_len=16, **overrides):
  config = ml_collections.ConfigDict(
      {"seq_len": seq_len, "input": sources.input_config(**overrides)}
  )
  return tasks.get_task(config)


def window_batch(stream, step=0, process_index=0, process_count=1, global_batch=8):
  it = batching.text_batches(
      stream,
      seq_len=16,
      global_batch=global_batch,
      seed=0,
      start_step=step,
      process_index=process_index,
      process_count=process_count,
  )
  return next(it)


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
  """TOKENS in 3 uint16 files of unequal size, plus a val file; returns the directory."""
  root = tmp_path_factory.mktemp("tokens")
  for i, part in enumerate(np.split(TOKENS, [7_000, 19_000])):
    part.tofile(root / f"train_{i}.bin")
  TOKENS[:2_000].tofile(root / "val.bin")
  return root


def test_token_files_are_memmapped_and_read_as_one_stream(shards):
  train, held_out = sources.open_tokens(
      spec(kind="tokens", train=str(shards / "train_*.bin"), val=str(shards / "val.bin"))
  )
  assert len(train.arrays) == 3 and all(isinstance(a, np.memmap) for a in train.arrays)
  assert (len(train), len(held_out)) == (30_000, 2_000)
  starts = np.array([0, 6_990, 18_995, 29_983])  # Two of them cross from one file into the next.
  expected = TOKENS[starts[:, None] + np.arange(17)]
  np.testing.assert_array_equal(train.windows(starts, 17), expected)


def test_held_out_tail_and_max_tokens(shards):
  train, held_out = sources.open_tokens(
      spec(kind="tokens", train=str(shards), eval_fraction=0.1, max_tokens=20_000)
  )  # A directory: every file in it, sorted (train_0, train_1, train_2, val).
  assert (len(train), len(held_out)) == (18_000, 2_000)
  np.testing.assert_array_equal(held_out.windows(np.array([0]), 5)[0], TOKENS[18_000:18_005])


def test_tuning_slice_is_disjoint_and_evaluated_when_set(shards):
  """[train | tune | eval] tile train's stream; the eval slice is the same with or without tune."""
  files = dict(kind="tokens", train=str(shards / "train_*.bin"), eval_fraction=0.1)
  span = lambda stream: (stream.start, stream.stop)
  slices = sources.token_slices(spec(tune_fraction=0.2, **files))
  bounds = [span(slices[k]) for k in ("train", "tune", "eval")]
  assert bounds == [(0, 21_000), (21_000, 27_000), (27_000, 30_000)]
  assert span(sources.token_slices(spec(**files))["eval"]) == (27_000, 30_000)
  t = task(tune_fraction=0.2, **files)
  assert [span(t.train), span(t.held_out)] == bounds[:2]  # The tuning slice is evaluated.
  np.testing.assert_array_equal(t.held_out.windows(np.array([0]), 3)[0], TOKENS[21_000:21_003])
  assert span(task(**files).held_out) == bounds[2]  # Off (0): the eval slice, as before.
  with_val = sources.token_slices(spec(tune_fraction=0.1, val=str(shards / "val.bin"), **files))
  assert [len(with_val[k]) for k in ("train", "tune", "eval")] == [27_000, 3_000, 2_000]


@pytest.mark.parametrize(
    "overrides, key",
    [
        (dict(tune_fraction=-0.1), "tune_fraction=-0.1 must be >= 0"),
        (dict(tune_fraction=0.95), "tune_fraction=0.95 must be >= 0"),
        (dict(kind="digits", tune_fraction=0.1), "applies to kind 'tokens' or 'text'"),
    ],
)
def test_bad_tune_fraction_names_the_key(overrides, key):
  with pytest.raises(ConfigError, match=key):
    spec(**{"kind": "text", **overrides})


@pytest.mark.parametrize("process_count", [2, 4])
def test_processes_read_their_rows_of_the_global_batch(shards, process_count):
  train = sources.token_stream(spec(kind="tokens", train=str(shards / "train_*.bin")), "train")
  for step in (0, 5):  # Step 5 as a run resumed there sees it: no iterator state.
    parts = [window_batch(train, step, p, process_count) for p in range(process_count)]
    np.testing.assert_array_equal(np.concatenate(parts), window_batch(train, step))
  assert not np.array_equal(window_batch(train, 0), window_batch(train, 1))


def test_text_directory_is_read_as_bytes(tmp_path):
  (tmp_path / "sub").mkdir()
  (tmp_path / "a.txt").write_text("héllo wörld " * 20)
  (tmp_path / "empty.txt").write_text("")
  (tmp_path / "sub" / "b.txt").write_text("second file " * 20)
  corpus = (tmp_path / "a.txt").read_bytes() + (tmp_path / "sub" / "b.txt").read_bytes()
  t = task(kind="text", train=str(tmp_path), eval_fraction=0.25)
  cut = len(corpus) - round(len(corpus) * 0.25)
  assert (len(t.train), len(t.held_out)) == (cut, len(corpus) - cut)
  window = t.train.windows(np.array([3]), 17)[0]
  assert bytes(window.astype(np.uint8)) == corpus[3:20]
  t.check(models.get_model("llama", size="tiny"))  # Bytes fit the 256-id vocab: no scan.


def test_named_inputs_keep_the_string_form():
  assert sources.input_spec("text").train == sources.STDLIB_TEXT
  assert sources.input_spec("digits").kind == "digits"
  with pytest.raises(ConfigError, match=r"config.input='txt' is not a named input"):
    sources.input_spec("txt")


def test_the_conversion_record_spares_the_scan(tmp_path):
  path = tmp_path / "train.bin"
  np.arange(100, dtype=np.uint16).tofile(path)
  stream = sources.token_stream(spec(kind="tokens", train=str(path)), "train")
  sources.check_token_ids(stream, 100)  # Scanned: ids 0..99 fit.
  path.with_suffix(".bin.json").write_text(json.dumps({"tokens": 100, "max_token": 100}))
  with pytest.raises(ConfigError, match="token id 100"):
    sources.check_token_ids(stream, 100)  # The record is believed.


def test_npy_images_are_memmapped_and_batched(tmp_path):
  images = (
      np.zeros((10, 4, 4, 3), np.uint8) + np.arange(0, 200, 20, dtype=np.uint8)[:, None, None, None]
  )
  np.save(tmp_path / "images.npy", images)
  np.save(tmp_path / "labels.npy", np.arange(10, dtype=np.int64) % 3)
  t = task(kind="images", train=str(tmp_path), eval_fraction=0.2)
  assert isinstance(t.train["image"], np.memmap) and len(t.held_out["label"]) == 2
  batch = next(t.batches(t.train, global_batch=4, seed=0))
  assert batch["image"].dtype == np.uint8 and batch["label"].dtype == np.int32
  for image, label in zip(batch["image"], batch["label"]):
    row = int(image[0, 0, 0]) // 20
    assert label == row % 3 and np.array_equal(image, images[row])
  assert float(np.max(t.inputs(batch))) <= 1.0
  t.check(models.get_model("vit", num_classes=3))


def _write(tmp_path, name, array):
  path = tmp_path / name
  np.asarray(array).tofile(path)
  return str(path)


@pytest.mark.parametrize(
    "case, message",
    [
        ("missing", r"config.input.train: .*nope.bin does not exist; point it at an existing file"),
        ("empty_glob", r"config.input.train='.*\*.tok' matches no files; check the path"),
        ("odd_size", r"odd.bin has 7 bytes, not a multiple of uint16's 2: is config.input.dtype"),
        (
            "short",
            r"config.input.val \(.*short.bin\) has 10 tokens, fewer than config.seq_len \+ 1",
        ),
        (
            "tail",
            r"held-out tail \(config.input.eval_fraction=0.01\) of train \(.*ok.bin\) has 10 ",
        ),
        ("too_big_id", r"big.bin holds token id 300, not below the model's vocab_size=256: set "),
        ("declared", r"config.input.vocab_size=50304 is larger than the model's vocab_size=256"),
        ("wrong_dtype", r"rec.bin holds uint32 tokens .* but config.input.dtype='uint16'"),
        ("empty_file", r"empty.bin is empty"),
        ("npz", r"images.npy does not exist \(.*data.npz is .npz, which cannot be memory-mapped\)"),
        ("float_images", r"images.npy is float32 \(4, 2, 2, 1\); expected uint8 \(N, H, W, C\)"),
        ("labels", r"labels.npy holds labels in \[\d, 5\] but the model has 3 classes; set"),
        ("kind", r"config.input.kind='token' is not one of"),
    ],
)
def test_bad_input_raises_naming_the_file_and_fix(tmp_path, case, message):
  ok = _write(tmp_path, "ok.bin", np.arange(1000, dtype=np.uint16) % 256)
  model = models.get_model("llama", size="tiny")
  with pytest.raises(ConfigError, match=message):
    if case == "missing":
      task(kind="tokens", train=str(tmp_path / "nope.bin"))
    elif case == "empty_glob":
      task(kind="tokens", train=str(tmp_path / "*.tok"))
    elif case == "odd_size":
      task(kind="tokens", train=_write(tmp_path, "odd.bin", np.zeros(7, np.uint8)))
    elif case == "short":
      task(kind="tokens", train=ok, val=_write(tmp_path, "short.bin", np.zeros(10, np.uint16)))
    elif case == "tail":
      task(kind="tokens", train=ok, eval_fraction=0.01)
    elif case == "too_big_id":
      big = _write(tmp_path, "big.bin", np.full(99, 300, np.uint16))
      task(kind="tokens", train=ok, val=big).check(model)
    elif case == "declared":
      task(kind="tokens", train=ok, vocab_size=50304).check(model)
    elif case == "wrong_dtype":
      path = _write(tmp_path, "rec.bin", np.zeros(100, np.uint32))
      (tmp_path / "rec.bin.json").write_text(json.dumps({"dtype": "uint32"}))
      task(kind="tokens", train=path)
    elif case == "empty_file":
      task(kind="tokens", train=ok, val=_write(tmp_path, "empty.bin", np.zeros(0, np.uint16)))
    elif case == "npz":
      np.savez(tmp_path / "data.npz", images=np.zeros((4, 2, 2, 1), np.uint8))
      task(kind="images", train=str(tmp_path))
    elif case == "float_images":
      np.save(tmp_path / "images.npy", np.zeros((4, 2, 2, 1), np.float32))
      np.save(tmp_path / "labels.npy", np.zeros(4, np.int32))
      task(kind="images", train=str(tmp_path))
    elif case == "labels":
      np.save(tmp_path / "images.npy", np.zeros((6, 2, 2, 1), np.uint8))
      np.save(tmp_path / "labels.npy", np.arange(6))
      task(kind="images", train=str(tmp_path), eval_fraction=0.5).check(
          models.get_model("vit", num_classes=3)
      )
    elif case == "kind":
      task(kind="token", train=ok)


def test_holdout_split_is_a_disjoint_tail():
  train, held_out = sources.holdout_split(HELD, 0.1)
  assert len(held_out) == 1000
  np.testing.assert_array_equal(np.concatenate([train, held_out]), HELD)
  train, held_out = sources.holdout_split(IMAGES, 0.2)
  assert set(train["label"]).isdisjoint(held_out["label"])
  assert len(train["image"]) + len(held_out["image"]) == 50


def test_load_digits():
  pytest.importorskip("sklearn")
  train, held_out = sources.load_digits(eval_fraction=0.2)
  assert train["image"].shape == (1438, 8, 8, 1)
  assert held_out["label"].shape == (359,)
  assert train["image"].dtype == np.float32 and train["label"].dtype == np.int32
  assert 0.0 <= train["image"].min() and train["image"].max() <= 1.0
  assert set(held_out["label"]) == set(range(10))


def test_a_folder_with_a_symlink_loop_lists_each_file_once(tmp_path, caplog):
  (tmp_path / "a.txt").write_text("some text\n")
  (tmp_path / "loop").symlink_to(tmp_path, target_is_directory=True)
  with caplog.at_level(logging.WARNING):
    files = sources.find_files(str(tmp_path), "the corpus argument")
  assert files == [str(tmp_path / "a.txt")]
  assert "name files already listed through symbolic links" in caplog.text
