"""trainers/settings/schema.py: every key declared once, with the default configs/common.py
gives it; the typed config built from a ConfigDict, read as attributes; and no module of the
trainer reading the ConfigDict by ``config.get`` outside the schema."""

import dataclasses
import re
import subprocess

import ml_collections
import pytest

from configs import common, lm, vit_digits
from tests.helpers import ROOT
from trainers.errors import ConfigError
from trainers.settings import schema, validation


def test_every_key_of_common_is_declared_once_with_its_default():
  base = common.base_config()
  assert list(schema.shared_defaults()) == sorted(base.keys(), key=list(schema.keys()).index)
  assert schema.shared_defaults() == base.to_dict()
  names = [f.name for concern in schema.Config.__bases__ for f in dataclasses.fields(concern)]
  assert len(names) == len(set(names)) == len(schema.keys())  # Each key in one concern.
  for key, value in schema.shared_defaults().items():  # None: a typed placeholder.
    if value is None:
      assert base._fields[key]._field_type is schema.placeholder_type(key), key


@pytest.mark.parametrize("module", [lm, vit_digits])
def test_a_config_reads_as_typed_attributes(module):
  loaded = module.get_config()
  config = schema.of(loaded)
  assert config.source is loaded and schema.of(config) is config
  for key in schema.keys():
    assert getattr(config, key) == loaded.get(key, getattr(config, key)), key
  with pytest.raises(dataclasses.FrozenInstanceError):
    config.lr = 1.0


def test_a_missing_key_reads_as_declared():
  config = schema.of(ml_collections.ConfigDict(dict(lr=1e-3)))
  assert (config.on_nonfinite, config.mesh_axis_types, config.grad_accum_steps) == (
      "stop",
      "auto",
      1,
  )
  # big_vision's reading of a section without them: no decay, no clipping.
  assert (config.wd, config.grad_clip_norm, config.ckpt_steps, config.seq_len) == (
      0.0,
      None,
      None,
      None,
  )
  assert schema.of({"lr": 2.0}).lr == 2.0


def test_no_trainer_module_reads_the_config_by_get():
  found = subprocess.run(
      ["git", "grep", "-c", "config.get(", "--", "trainers/"],
      cwd=ROOT,
      capture_output=True,
      text=True,
  ).stdout.split()
  found = [line for line in found if not line.startswith("trainers/settings/schema.py:")]
  # rundir/checkpoint.py's three go with the run-start policy leaving it (issue 33).
  assert found in ([], ["trainers/rundir/checkpoint.py:3"]), found


# What ``config.<name>`` also spells in trainers/: files and methods, a model's own config,
# the command line's examples (a misspelt key, a toy config's keys).
NOT_KEYS = {"json", "source", "get", "to_json_best_effort", "to_dict", "max_len", "key", "value"}
NOT_KEYS |= {"lrr", "size", "a"}


def test_every_key_the_trainer_reads_is_declared():
  read = {
      m.group(1): str(path)
      for path in sorted((ROOT / "trainers").rglob("*.py"))
      for m in re.finditer(r"(?<![\w.])config\.([a-z_]+)", path.read_text())
  }
  assert {k: p for k, p in read.items() if k not in schema.keys() and k not in NOT_KEYS} == {}


def test_every_key_has_a_meaning_and_the_checked_ones_reject_a_bad_value():
  assert all(f.metadata["doc"] for f in schema.keys().values())
  config = lm.get_config()
  for name, f in schema.keys().items():
    if f.metadata["check"] is not None:
      bad = lm.get_config()
      with bad.ignore_type():
        setattr(bad, name, ["not", "a", "value"] if name != "data_axes" else ("data", "data"))
      with pytest.raises(ConfigError, match=rf"config\.{name}="):
        validation.check_config(bad)
  validation.check_config(config)
