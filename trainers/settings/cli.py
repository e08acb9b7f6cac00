"""The commands' one dialect: snake_case flags, and errors of ours as one line, exit status 1.

Every command (``trainers.train``, ``trainers.plan``, ``trainers.launch``,
``trainers.convert``, ``trainers.sample``) and every benchmark takes snake_case flags. The
dashed spellings of older scripts (``--num-devices``) still parse, each with a one-line
deprecation note on stderr (:func:`snake_case`); ``--help`` shows the snake_case ones only. A bad input ends
as exactly one line on stderr, ``ConfigError: <what> <fix>``, with exit status 1; ``--debug``
(or ``BV_DEBUG=1``) shows the full traceback instead (:func:`fail`).

``run(main)`` is ``absl.app.run(main)`` with a flags parser that loads ``--config`` first and
turns each config-loading mistake into one ``ConfigError`` line naming the file or key: a
missing ``--config``, a missing file, a syntax error, no ``get_config``, a ``get_config`` that
raises, an override of a key the config file does not define (with the closest key), or
an override value of the wrong type. Any ``bvs.Error`` raised in ``main`` is printed the same
way. Commands on ``argparse`` build their parser with :class:`Parser` (a usage mistake, such
as an unknown flag, raises ``ConfigError``) and wrap their ``main`` in :func:`command`.

Keys under ``config.optax`` are the optimizer's keyword arguments: any may be added from
the command line (``--config.optax.b1=0.9``); the optimizer's signature checks them.

``run(main)`` ends ``trainers/train.py``; on the command line a mistake reads::

  $ python -m trainers.train --config configs/lm.py --config.lrr=1 --workdir /tmp/x
  ConfigError: --config.lrr: configs/lm.py has no key config.lrr; did you mean 'lr'?

Example:
  >>> import os, tempfile
  >>> path = os.path.join(tempfile.mkdtemp(), "tiny.py")
  >>> with open(path, "w") as f:
  ...   _ = f.write("import ml_collections\\n"
  ...               "def get_config(arg=None):\\n"
  ...               "  return ml_collections.ConfigDict({'lr': 1e-3, 'size': arg})\\n")
  >>> config = load_config(config_spec(["train", "--config", path + ":small"]))
  >>> config.lr, config.size
  (0.001, 'small')
  >>> config_from_args(["--config", path, "--config.lr=0.1"]).lr
  0.1
  >>> check_overrides(config, {"lrr": 1.0}, path)
  Traceback (most recent call last):
  ...
  bv_sharding.errors.ConfigError: --config.lrr: ... has no key config.lrr; did you mean 'lr'? ...
  >>> parser = Parser("python -m tool", "A tool.")
  >>> _ = parser.add_argument("--num_devices", type=int)
  >>> parser.parse_args(["--num_devices=8"]).num_devices
  8
  >>> parser.parse_args(["--num_device=8"])
  Traceback (most recent call last):
  ...
  bv_sharding.errors.ConfigError: unrecognized arguments: --num_device=8; see python -m tool --help
"""

import argparse
import ast
import copy
import functools
import importlib.util
import math
import os
import sys
from collections.abc import Callable, Mapping

from absl import app, flags
from ml_collections import config_flags

from bv_sharding import Error
from trainers.errors import ConfigError, closest
from trainers.settings import held

CONFIG_FLAG = "config"
OPEN_DICTS = ("optax",)  # Keyword-argument dicts: the command line may add any key.
DEBUG_ENV = "BV_DEBUG"
HELP = ("-h", "--help", "--helpshort", "--helpfull", "-?")
DEBUG_HELP = f"full tracebacks for errors of ours (or {DEBUG_ENV}=1)"

flags.DEFINE_bool("debug", False, DEBUG_HELP)


def run(main) -> None:
  """``app.run(main)``; errors of ours (config loading or in ``main``) end as one line, status 1.

  Example: ``run(main)`` at the bottom of trainers/train.py.
  """
  app.run(command(main), flags_parser=parse_flags)


def command(main):
  """``main(argv=None)`` whose errors of ours end as one line on stderr and exit status 1.

  Example: ``@cli.command`` above ``def main(argv=None)`` in trainers/plan.py.
  """

  @functools.wraps(main)
  def reporting(argv=None):
    try:
      return main(argv)
    except Error as e:
      fail(e, argv)
    finally:
      held.release()  # Start-up lines still held (trainers/settings/held.py): an error not ours.

  return reporting


class Parser(argparse.ArgumentParser):
  """An ``argparse`` parser in the commands' dialect.

  Flags are defined snake_case; their dashed spellings parse too, with a deprecation note
  (:func:`snake_case`); a flag's name is never abbreviated. ``--debug`` is defined. A usage
  mistake (an unknown flag, a missing or malformed argument) raises ``ConfigError`` instead
  of exiting 2.

  Example: ``Parser("python -m trainers.convert", __doc__)``, then ``add_argument``.
  """

  def __init__(self, prog: str, doc: str | None):
    self.flags = set()  # Names of the long flags, for their dashed spellings.
    super().__init__(
        prog=prog,
        description=doc,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,  # Whole names only, as the trainer's absl flags.
    )
    self.add_argument("--debug", action="store_true", help=DEBUG_HELP)

  def add_argument(self, *names, **kwargs):
    self.flags.update(name[2:] for name in names if name.startswith("--"))
    return super().add_argument(*names, **kwargs)

  def parse_known_args(self, args=None, namespace=None):
    args = sys.argv[1:] if args is None else args
    return super().parse_known_args(snake_case(args, self.flags), namespace)

  def error(self, message: str):
    raise ConfigError(f"{message}; see {self.prog} --help")


def snake_case(args: list[str], names) -> list[str]:
  """``args`` with the dashed spelling of each flag in ``names`` (``--num-devices``) turned into
  its snake_case one, noting on stderr that it is deprecated; ``--`` ends the flags.

  Example: ``snake_case(["--num-devices=8"], {"num_devices"})`` == ["--num_devices=8"] and
  "--num-devices is deprecated: use --num_devices" on stderr.
  """
  out = list(args)
  for i, arg in enumerate(out):
    if arg == "--":
      break
    flag, eq, value = arg.partition("=")
    name = flag[2:].replace("-", "_")
    if flag.startswith("--") and "-" in flag[2:] and name in names:
      print(f"{flag} is deprecated: use --{name}", file=sys.stderr)
      out[i] = f"--{name}{eq}{value}"
  return out


def at_least(low: int, high: int | None = None, why: str = ""):
  """An argparse ``type``: integers >= ``low`` (e.g. of ``trainers.convert --workers``), and
  <= ``high`` if given (``why`` says why).

  Example: ``at_least(1)("4")`` == 4; ``at_least(1)("0")`` raises ArgumentTypeError.
  """

  def parse(text: str) -> int:
    try:
      value = int(text)
    except ValueError:
      value = low - 1
    if value < low:
      raise argparse.ArgumentTypeError(f"{text!r} is not an integer >= {low}")
    if high is not None and value > high:
      raise argparse.ArgumentTypeError(f"{text!r} is over {high}{why}")
    return value

  return parse


def number_in(accepts: Callable[[float], bool], expected: str) -> Callable[[str], float]:
  """An argparse ``type``: numbers ``accepts`` takes; any other text raises
  ArgumentTypeError saying it is not ``expected``.

  Example: ``number_in(lambda v: v > 0, "a number > 0")("2")`` == 2.0.
  """

  def parse(text: str) -> float:
    try:
      value = float(text)
    except ValueError:
      value = math.nan
    if not accepts(value):
      raise argparse.ArgumentTypeError(f"{text!r} is not {expected}")
    return value

  return parse


# A number in [0, 1] (e.g. ``trainers.plan --max_unsharded_fraction``).
fraction = number_in(lambda v: 0 <= v <= 1, "a fraction in [0, 1], e.g. 0.02")
# Strictly between 0 and 1 (``trainers.convert --val_fraction``: 0 or 1 leaves a split empty).
open_fraction = number_in(
    lambda v: 0 < v < 1,
    "a fraction strictly between 0 and 1 (0 or 1 leaves a split empty), e.g. 0.01",
)
# A finite number >= 0 (``trainers.sample --temperature``).
non_negative = number_in(lambda v: 0 <= v < math.inf, "a finite number >= 0")


def new_file(text: str) -> str:
  """A file path whose directory exists and is writable: an argparse ``type`` (e.g. of
  ``trainers.plan --png``), so a command stops before its work, not at its end.

  Example: ``new_file("plan.png")`` == "plan.png"; ``new_file("/no/such/dir/x.png")`` raises
  ArgumentTypeError.
  """
  folder = os.path.dirname(text) or "."
  if not text or not os.path.isdir(folder) or not os.access(folder, os.W_OK):
    raise argparse.ArgumentTypeError(
        f"{text!r}: its directory {folder} does not exist or is not writable"
    )
  return text


def parse_flags(argv: list[str], flag_values=flags.FLAGS) -> list[str]:
  """Loads the ``--config`` file, then parses all flags (dashed spellings noted, as by
  :func:`snake_case`); any mistake is one ``ConfigError`` line.

  Example: ``parse_flags(["train", "--config=configs/lm.py", "--workdir=/tmp/x"])``.
  """
  argv = [argv[0], *snake_case(argv[1:], set(flag_values))]
  try:
    if any(arg.split("=")[0] in HELP for arg in argv):
      return flag_values(argv)
    return parse_with_config(argv, flag_values)
  except Error as e:
    fail(e, argv)


def define_config_flag(flag_values=flags.FLAGS, argv=None) -> flags.FlagHolder:
  """Defines ``--config`` and its ``--config.key=value`` overrides (those in ``argv``).

  The config stays unlocked and takes new keys: :func:`check_overrides` rejects a key
  the config file does not define, except under ``OPEN_DICTS``.

  Example: ``_CONFIG = define_config_flag()`` in trainers/train.py.
  """
  return config_flags.DEFINE_config_file(
      CONFIG_FLAG,
      None,
      "Training config file.",
      flag_values=flag_values,
      lock_config=False,
      accept_new_attributes=True,
      sys_argv=argv,
  )


def parse_with_config(argv: list[str], flag_values, loaded=None) -> list[str]:
  """Parses ``argv`` into ``flag_values`` after loading its ``--config`` file by itself (or
  taking ``loaded``, that file's config loaded already), so each mistake is a
  ``ConfigError``; returns the arguments that are not flags.

  Example: ``parse_with_config(["train", "--config=configs/lm.py"], flags.FLAGS)``.
  """
  spec = config_spec(argv)
  defined = load_config(spec) if loaded is None else loaded
  flag = flag_values[CONFIG_FLAG]
  flag.parser, own = Loaded(defined), flag.parser  # The file is executed once, above.
  try:
    rest = flag_values(argv)
  except (flags.Error, AttributeError, KeyError, TypeError, ValueError) as e:
    raise ConfigError(f"command line: {e}") from e
  finally:
    flag.parser = own
  check_overrides(defined, config_flags.get_override_values(flag_values[CONFIG_FLAG]), spec)
  return rest


class Loaded(flags.ArgumentParser):
  """The ``--config`` flag's parser, handing out a copy of a config loaded already, so the
  file is executed once per load (the flag's own parser would execute it again); the
  overrides then change that copy, and the loaded config stays as the file defined it
  (:func:`check_overrides` compares with it).

  Example: ``flag_values["config"].parser = Loaded(load_config(spec))`` while parsing.
  """

  def __init__(self, config):
    self.config = config

  def parse(self, argument):
    del argument  # The very file loaded: parse_with_config reads --config from the same argv.
    return copy.deepcopy(self.config)

  def flag_type(self):
    return "config object"


def config_from_args(args: list[str], loaded=None):
  """The config of ``--config file.py[:arg]`` in ``args``, with its ``--config.key=value``
  overrides: the trainer's loading and checks, on flags of its own (for other commands).
  ``loaded``: that file's config, loaded already (``load_config``), for a command that
  applies two sets of overrides to one load (``trainers.plan --diff``).

  Example: ``config_from_args(["--config=configs/lm.py", "--config.lr=0.1"]).lr`` == 0.1.
  """
  argv, values = [sys.argv[0], *args], flags.FlagValues()
  config = define_config_flag(values, argv)
  parse_with_config(argv, values, loaded)
  return config.value


def fail(error: Exception, argv=None) -> None:
  """Prints ``error`` as one line to stderr and exits 1 (re-raises it under --debug, in
  ``sys.argv`` or ``argv``, or BV_DEBUG=1).

  Example: ``fail(ConfigError("config.lr=-1.0: must be ..."))`` prints "ConfigError: config.lr=...".
  """
  held.drop()  # The start-up's held lines, but the command's own warnings.
  if os.environ.get(DEBUG_ENV) == "1" or "--debug" in (*sys.argv, *(argv or ())):
    raise error
  message = " ".join(str(error).split("\n"))
  sys.stderr.write(f"{type(error).__name__}: {message}\n")
  if getattr(error, "exit_at_once", False):  # Threads still failing: no shutdown to report on.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)
  sys.exit(1)


def config_spec(argv: list[str]) -> str:
  """The value of ``--config`` (``path`` or ``path:arg``) in ``argv``.

  Example: ``config_spec(["train", "--config", "configs/lm.py"])`` == "configs/lm.py".
  """
  for i, arg in enumerate(argv):
    name, eq, value = arg.lstrip("-").partition("=")
    if arg.startswith("-") and name == CONFIG_FLAG:
      if eq:
        return value
      if i + 1 < len(argv):
        return argv[i + 1]
  raise ConfigError(
      "--config is missing: name a config file, e.g. --config configs/lm.py "
      "(or configs/lm.py:size=small)"
  )


def load_config(spec: str):
  """Runs ``get_config(arg)`` of file ``spec`` ("path[:arg]"); each mistake is a ``ConfigError``.

  Example: ``load_config("configs/lm.py:size=small").model.size`` == "small".
  """
  path, *arg = spec.split(":", 1)
  where = f"--config={spec}"
  if not os.path.isfile(path):
    folder = os.path.dirname(path) or "."
    near = os.listdir(folder) if os.path.isdir(folder) else []
    hint = closest(os.path.basename(path), near)
    raise ConfigError(f"{where}: file {path!r} not found{hint}")
  with open(path) as f:
    source = f.read()
  try:
    ast.parse(source, filename=path)
  except SyntaxError as e:
    raise ConfigError(f"{where}: syntax error in {path} line {e.lineno}: {e.msg}") from e
  module = _execute(path, where)
  if not callable(getattr(module, "get_config", None)):
    raise ConfigError(
        f"{where}: {path} defines no get_config(); a config file defines "
        "get_config(arg=None) returning an ml_collections.ConfigDict"
    )
  try:
    config = module.get_config(*arg)
  except Exception as e:  # A config file is user code: any failure is reported as theirs.
    raise ConfigError(f"{where}: get_config({', '.join(map(repr, arg))}) raised: {e}") from e
  if not isinstance(config, Mapping) and not hasattr(config, "to_dict"):
    raise ConfigError(f"{where}: get_config() returned {type(config).__name__}, not a ConfigDict")
  return config


def check_overrides(defined, overrides: Mapping, spec: str) -> None:
  """Raises for an override ``--config.a.b`` whose key the config file does not define.

  Keys under ``OPEN_DICTS`` (optimizer keyword arguments) may be new.

  Example: ``check_overrides(config, {"lrr": 1.0}, "configs/lm.py")`` raises "did you mean 'lr'?".
  """
  for key in overrides:
    parts = key.split(".")
    if parts[0] in OPEN_DICTS:
      continue
    node = defined
    for depth, part in enumerate(parts):
      if not hasattr(node, "keys") or part not in node:
        known = list(node.keys()) if hasattr(node, "keys") else []
        name = ".".join(parts[: depth + 1])
        raise ConfigError(
            f"--config.{key}: {spec.split(':')[0]} has no key config.{name}"
            f"{closest(part, known) or '.'} Override keys the config defines "
            f"(or optimizer arguments as --config.optax.<name>=<value>)"
        )
      node = node[part]


def _execute(path: str, where: str):
  spec = importlib.util.spec_from_file_location("bv_config_file", path)
  module = importlib.util.module_from_spec(spec)
  try:
    spec.loader.exec_module(module)
  except Exception as e:  # User code: an import or a name error in the config file.
    raise ConfigError(f"{where}: loading {path} raised {type(e).__name__}: {e}") from e
  return module
