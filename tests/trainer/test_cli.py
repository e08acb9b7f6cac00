"""trainers/cli.py: loading a config, one line naming the file or key, no chained traceback."""

import pathlib

import pytest

import configs.lm
from tests.helpers import run_module
from trainers import cli
from trainers.errors import ConfigError


def write(path: pathlib.Path, text: str) -> str:
  path.write_text(text)
  return str(path)


@pytest.mark.parametrize(
    "source, message",
    [
        ("def get_config(:\n", "syntax error in {path} line 1"),
        ("x = 1\n", "{path} defines no get_config()"),
        ("import not_a_module_here\n", "loading {path} raised ModuleNotFoundError"),
        ("def get_config(arg=None):\n  return 1 / 0\n", "get_config() raised: division by zero"),
        ("def get_config(arg=None):\n  return None\n", "get_config() returned NoneType"),
    ],
)
def test_config_file_mistakes(tmp_path, source, message):
  path = write(tmp_path / "c.py", source)
  with pytest.raises(ConfigError, match=f"--config={path}: .*") as e:
    cli.load_config(path)
  assert message.format(path=path) in str(e.value)


def test_missing_config_and_missing_file(tmp_path):
  with pytest.raises(ConfigError, match="--config is missing"):
    cli.config_spec(["train", "--workdir=/tmp/x"])
  assert cli.config_spec(["train", "--config", "a.py:x"]) == "a.py:x"
  with pytest.raises(ConfigError, match=r"file 'configs/lmm\.py' not found; did you mean 'lm\.py'"):
    cli.load_config("configs/lmm.py")
  with pytest.raises(ConfigError, match=r"get_config\('sise=small'\) raised: config arg 'sise"):
    cli.load_config("configs/lm.py:sise=small")
  assert cli.load_config("configs/lm.py:size=small").model.size == "small"


def test_override_of_an_unknown_key_names_the_closest():
  config = configs.lm.get_config()
  cli.check_overrides(config, {"lr": 1.0, "model.size": "small", "optax.b1": 0.9}, "c.py")
  with pytest.raises(ConfigError, match=r"--config\.lrr: c\.py has no key config\.lrr; did you"):
    cli.check_overrides(config, {"lrr": 1.0}, "c.py")
  with pytest.raises(ConfigError, match=r"config\.model\.sise; did you mean 'size'"):
    cli.check_overrides(config, {"model.sise": 1}, "c.py")
  with pytest.raises(ConfigError, match=r"config\.lr\.x"):
    cli.check_overrides(config, {"lr.x": 1}, "c.py")


def test_config_loading_errors_through_the_entry_point(tmp_path):
  """Each is one line and exit status 1; --debug (BV_DEBUG=1) shows the traceback."""
  bad = write(tmp_path / "bad.py", "def get_config(:\n")
  cases = [
      ((f"--workdir={tmp_path}",), "ConfigError: --config is missing"),
      ((f"--config={bad}", f"--workdir={tmp_path}"), f"ConfigError: --config={bad}: syntax error"),
      (
          ("--config=configs/lm.py", "--config.lrr=1", f"--workdir={tmp_path}"),
          "ConfigError: --config.lrr: configs/lm.py has no key config.lrr; did you mean 'lr'?",
      ),
      (
          ("--config=configs/lm.py", "--config.lr=abc", f"--workdir={tmp_path}"),
          "ConfigError: command line: flag --config.lr=abc",
      ),
  ]
  for args, message in cases:
    done = run_module("trainers.train", *args, timeout=120)
    status, out = done.returncode, done.stdout + done.stderr
    assert status == 1 and out.startswith(message), out
    assert "Traceback" not in out and len(out.strip().splitlines()) == 1, out
  assert list(tmp_path.iterdir()) == [pathlib.Path(bad)]
  done = run_module(
      "trainers.train",
      f"--config={bad}",
      f"--workdir={tmp_path}",
      env={"BV_DEBUG": "1"},
      timeout=120,
  )
  status, out = done.returncode, done.stdout + done.stderr
  assert status != 0 and "Traceback" in out and "syntax error" in out
