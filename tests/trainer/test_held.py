"""trainers/settings/held.py: a command's start-up lines wait for its checks; an error of ours
comes first, after the project's own warnings only."""

import io
import logging
import warnings

import pytest

import bv_sharding as bvs
from tests.helpers import run_module
from trainers.errors import ConfigError
from trainers.settings import cli, held


@pytest.fixture
def printed(caplog):
  """What the root logger's handler (absl's INFO lines too) and Python's warnings print."""
  caplog.set_level("INFO", logger="absl")
  out, root = io.StringIO(), logging.getLogger()
  handler = logging.StreamHandler(out)
  root.addHandler(handler)
  with warnings.catch_warnings():
    warnings.simplefilter("always")
    warnings.showwarning = lambda m, c, *a, **k: out.write(f"{c.__name__}: {m}\n")
    yield out
  root.removeHandler(handler)


def start_up_lines():
  logging.getLogger("absl").info("mesh {'data': 8}")
  logging.getLogger("jax._src.xla_bridge").warning("a library's warning")
  warnings.warn("a runtime's notice", UserWarning, stacklevel=1)
  warnings.warn("['typo'] match no leaf", bvs.ShardingWarning, stacklevel=1)
  logging.getLogger("absl").warning("our warning")


def test_held_lines_print_in_order_once_released(printed):
  held.hold()
  start_up_lines()
  assert printed.getvalue() == ""
  held.release()
  assert printed.getvalue().splitlines() == [
      "mesh {'data': 8}",
      "a library's warning",
      "UserWarning: a runtime's notice",
      "ShardingWarning: ['typo'] match no leaf",
      "our warning",
  ]
  logging.getLogger("absl").warning("after")  # No longer held.
  assert printed.getvalue().splitlines()[-1] == "after"


def test_an_error_of_ours_keeps_only_our_warnings_before_its_line(printed, capsys):
  def main(argv):
    held.hold()
    start_up_lines()
    raise ConfigError("config.x: the fix")

  with pytest.raises(SystemExit):
    cli.command(main)([])
  assert printed.getvalue().splitlines() == [
      "ShardingWarning: ['typo'] match no leaf",
      "our warning",
  ]
  assert capsys.readouterr().err == "ConfigError: config.x: the fix\n"


def test_an_error_not_ours_prints_every_held_line_before_its_traceback(printed):
  def main(argv):
    held.hold()
    start_up_lines()
    raise ZeroDivisionError

  with pytest.raises(ZeroDivisionError):
    cli.command(main)([])
  assert len(printed.getvalue().splitlines()) == 5


def test_the_trainers_optimizer_typo_is_its_only_line(tmp_path):
  """Found after the backend, the mesh and the data started (each logs a line): none shows."""
  done = run_module(
      "trainers.train",
      "--config=configs/lm.py",
      f"--workdir={tmp_path / 'run'}",
      "--config.optax_name=adamx",
      timeout=120,
  )
  lines = (done.stdout + done.stderr).splitlines()
  assert done.returncode == 1 and len(lines) == 1, lines
  assert lines[0].startswith("OptimizerError: config.optax_name='adamx'") and "adamax" in lines[0]
  assert not (tmp_path / "run").exists()
