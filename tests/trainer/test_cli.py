"""trainers/settings/cli.py: loading a config (one line naming the file or key, no chained traceback), the
commands' one dialect (snake_case flags, dashed spellings noted) and one way to report a bad input
(one line, exit status 1, the traceback only under --debug).

The commands themselves are checked in tests/e2e/test_<command>.py; here the mechanism, in
process, and the flag definitions of every command and benchmark, read from their sources.
"""

import pathlib
import re

import pytest
from absl import flags

import configs.lm
from tests.helpers import DASHED_FLAG, ROOT, run_module
from trainers.errors import ConfigError
from trainers.settings import cli


def parser() -> cli.Parser:
  p = cli.Parser("python -m tool", "A tool.")
  p.add_argument("--num_devices", type=int)
  p.add_argument("--max_unsharded_fraction", type=cli.fraction)
  p.add_argument("--only_2d", action="store_true")
  p.add_argument("path")
  return p


def test_snake_case_flags_parse_and_help_shows_only_them(capsys):
  args = parser().parse_args(
      ["--num_devices=8", "--only_2d", "--max_unsharded_fraction", "0.5", "x"]
  )
  assert (args.num_devices, args.only_2d, args.max_unsharded_fraction, args.path) == (
      8,
      True,
      0.5,
      "x",
  )
  assert capsys.readouterr().err == ""
  text = parser().format_help()
  assert "--num_devices" in text and "--max_unsharded_fraction" in text and "--debug" in text
  assert not DASHED_FLAG.search(text), text


def test_dashed_spellings_still_parse_each_with_one_note(capsys):
  args = parser().parse_args(
      ["--num-devices", "8", "--max-unsharded-fraction=0.5", "--only-2d", "x"]
  )
  assert (args.num_devices, args.only_2d, args.max_unsharded_fraction) == (8, True, 0.5)
  assert capsys.readouterr().err.splitlines() == [
      "--num-devices is deprecated: use --num_devices",
      "--max-unsharded-fraction is deprecated: use --max_unsharded_fraction",
      "--only-2d is deprecated: use --only_2d",
  ]


def test_snake_case_leaves_unknown_flags_and_what_follows_double_dash():
  args = ["--num-devices=2", "--config.a-b=1", "--other-flag", "--", "--num-devices=3"]
  assert cli.snake_case(args, {"num_devices"}) == [
      "--num_devices=2",
      "--config.a-b=1",
      "--other-flag",
      "--",
      "--num-devices=3",
  ]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--num_device=8", "x"], "unrecognized arguments: --num_device=8"),
        ([], "the following arguments are required: path"),
        (["--num_devices=eight", "x"], "argument --num_devices: invalid int value: 'eight'"),
        (["--max_unsharded_fraction=2", "x"], "'2' is not a fraction in [0, 1], e.g. 0.02"),
    ],
)
def test_usage_mistakes_raise_config_error_naming_the_fix(args, message):
  with pytest.raises(ConfigError) as raised:
    parser().parse_args(args)
  assert message in str(raised.value) and str(raised.value).endswith("; see python -m tool --help")


def failing(argv=None):
  parser().parse_args(argv)
  raise ConfigError("config.lr=-1.0: must be > 0, e.g. --config.lr=3e-3")


def test_command_prints_one_line_and_exits_1(capsys):
  with pytest.raises(SystemExit) as exited:
    cli.command(failing)(["x"])
  assert exited.value.code == 1
  out = capsys.readouterr()
  assert out.out == ""
  assert out.err == "ConfigError: config.lr=-1.0: must be > 0, e.g. --config.lr=3e-3\n"
  with pytest.raises(SystemExit) as exited:
    cli.command(failing)([])  # A usage mistake: the same one line.
  assert exited.value.code == 1
  assert capsys.readouterr().err.startswith("ConfigError: the following arguments are required")


def test_command_passes_results_and_other_errors_through():
  assert cli.command(lambda argv: len(argv))(["a", "b"]) == 2
  with pytest.raises(ZeroDivisionError):  # A bug of ours keeps its traceback.
    cli.command(lambda argv: 1 / 0)([])


def test_debug_or_bv_debug_shows_the_traceback(monkeypatch):
  with pytest.raises(ConfigError, match="config.lr=-1.0"):
    cli.command(failing)(["x", "--debug"])
  monkeypatch.setenv(cli.DEBUG_ENV, "1")
  with pytest.raises(ConfigError, match="config.lr=-1.0"):
    cli.command(failing)(["x"])


def test_absl_flags_take_dashed_spellings_with_a_note(tmp_path, capsys):
  """The trainer's parser (``cli.parse_flags``) on flags of its own: the same dialect."""
  values = flags.FlagValues()
  flags.DEFINE_integer("devices_per_process", 8, "devices", flag_values=values)
  cli.define_config_flag(values, ["train"])
  config = tmp_path / "c.py"
  config.write_text(
      "import ml_collections\ndef get_config():\n  return ml_collections.ConfigDict()\n"
  )
  argv = ["train", f"--config={config}", "--devices-per-process=2"]
  assert cli.parse_flags(argv, values) == ["train"]
  assert values.devices_per_process == 2
  assert (
      capsys.readouterr().err == "--devices-per-process is deprecated: use --devices_per_process\n"
  )
  with pytest.raises(SystemExit) as exited:
    cli.parse_flags(["train", f"--config={config}", "--devices_per_process=two"], values)
  assert exited.value.code == 1
  err = capsys.readouterr().err
  assert err.startswith("ConfigError: command line: flag --devices_per_process=two") and (
      len(err.splitlines()) == 1
  ), err


def test_every_command_and_benchmark_defines_snake_case_flags():
  """Flag definitions in trainers/ and benchmarks/: no multi-word name spelled with dashes."""
  definition = re.compile(r"""(add_argument|DEFINE_\w+)\(\s*["'](--)?([\w-]+)""")
  found = {}
  for path in [*ROOT.glob("trainers/**/*.py"), *ROOT.glob("benchmarks/*.py")]:
    for _, _, name in definition.findall(pathlib.Path(path).read_text()):
      found[name] = path
  assert {"num_devices", "dcn_mesh", "devices_per_process", "only_2d", "factor_rows"} <= set(found)
  assert [name for name in found if "-" in name] == []


# Config loading.


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


COUNTED = """import ml_collections
with open({count!r}, "a") as f:
  f.write("executed\\n")
def get_config(arg=None):
  return ml_collections.ConfigDict(
      dict(lr=1e-3, size=arg, device_memory_gib=ml_collections.config_dict.placeholder(float)))
"""


def test_the_config_file_is_executed_once_per_load(tmp_path):
  """load + overrides (config_from_args, the trainer's parse_flags): one execution each."""
  count = tmp_path / "count"
  path = write(tmp_path / "counted.py", COUNTED.format(count=str(count)))
  config = cli.config_from_args(
      [f"--config={path}:small", "--config.lr=0.1", "--config.device_memory_gib=80"]
  )
  assert (config.lr, config.size, config.device_memory_gib) == (0.1, "small", 80.0)
  assert count.read_text().splitlines() == ["executed"]
  argv = ["train", "--config", path, "--config.lr=0.2"]
  values = flags.FlagValues()
  holder = cli.define_config_flag(values, argv)
  assert cli.parse_flags(argv, values) == ["train"]
  assert holder.value.lr == 0.2
  assert count.read_text().splitlines() == ["executed"] * 2
  with pytest.raises(ConfigError, match=r"--config\.lrr: .* has no key config\.lrr"):
    cli.config_from_args([f"--config={path}", "--config.lrr=0.1"])  # Checked against the file's.
