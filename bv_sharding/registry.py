"""Registry of sharding ops and the parser for op-chain config strings.

An op is registered as a factory: its arguments come from the config string, and
it returns a rule ``rule(leaf, spec) -> (spec, note)`` (see ``bv_sharding.specs``).
Config strings are parsed with ``ast``; arguments must be literals, nothing is
evaluated. big_vision's syntax is accepted as big_vision's registry accepts it: a
bare name is the call without arguments (``'replicate'``), arguments may be
positional, and spaces may surround ``|``. :func:`temporary_ops` registers ops for
one ``with`` block only (tests, benchmarks, trying an op), so nothing stays
registered as a side effect.

Example:
  >>> import bv_sharding as bvs
  >>> ops = bvs.parse_chain('shard_dim(axis="model", dim=-1)|fsdp(axis="data")')
  >>> [op.name for op in ops]
  ['shard_dim', 'fsdp']
"""

import ast
import contextlib
import dataclasses
import inspect
import io
import tokenize
from collections.abc import Callable
from typing import Any

from bv_sharding import specs
from bv_sharding.errors import ShardingError, closest

MAX_CHAIN_CHARS = 2000
_OPS: dict[str, "OpInfo"] = {}


@dataclasses.dataclass(frozen=True)
class OpInfo:
  """A registered op: its factory and how it treats optimizer state.

  ``follows=True`` (sharding ops): on a state leaf that follows a param the op
  carries that param's spec over instead of choosing dims itself.
  ``follows=False`` (``replicate`` and state-specific ops): the op always acts.

  ``storage_only``: which mesh axes the op places only to save memory (FSDP, ZeRO),
  so that consumers gather them for compute under Explicit axes (see
  :mod:`bv_sharding.compute`): ``True`` every axis it places, ``False`` none (the
  axes are compute axes, e.g. tensor-parallel ones), or the name of the factory's
  argument that lists them (``logical_partitioning``'s ``storage_only``).
  """

  name: str
  factory: Callable[..., Callable]
  follows: bool
  storage_only: bool | str = False

  @property
  def signature(self) -> str:
    return f"{self.name}{inspect.signature(self.factory)}"


@dataclasses.dataclass(frozen=True)
class Op:
  """One parsed and bound op of a chain: ``text`` as written, ``rule`` to apply."""

  name: str
  text: str
  arguments: dict[str, Any]
  rule: Callable
  follows: bool
  storage_only: bool | tuple[str, ...] = False
  """``True``: every axis the op places is storage-only; a tuple: those mesh axes are;
  ``False``: none is."""


def register(name: str, *, follows: bool = True, storage_only: bool | str = False):
  """Decorator registering an op factory under ``name`` for the rest of the process.

  Put it above a factory in a module of your own; the factory's arguments come
  from the config string and it returns ``rule(leaf, spec) -> (spec, note)``.

  Args:
    name: the op's name in config strings (a Python identifier).
    follows: on a state leaf that follows a param, carry the param's spec over
      instead of calling the rule (sharding ops); ``False`` for ops that always act.
    storage_only: whether the axes the op places on params exist only to save memory
      (``True``: an FSDP- or ZeRO-like op; a param's compute spec drops them), or the
      name of the factory argument listing such mesh axes. The default ``False`` keeps
      every axis in the compute spec, as tensor parallelism needs: a plan never gathers
      what its op did not declare gatherable, so a wrong default costs an explicit
      ``ShardingTypeError`` under Explicit axes (nothing under Auto ones), never a silent
      all-gather of a weight that was split because it does not fit.

  Raises:
    ShardingError: another factory is already registered under ``name``, or
      ``storage_only`` names no argument of the factory.

  Example:
    >>> from bv_sharding.specs import place
    >>> with temporary_ops():  # registered inside the block only
    ...   @register("shard_last")
    ...   def shard_last(axis):
    ...     return lambda leaf, spec: place(leaf, spec, -1, axis)
    ...   [op.name for op in parse_chain('shard_last(axis="data")')]
    ['shard_last']
  """

  if not isinstance(name, str) or not name.isidentifier():
    raise ShardingError(
        f"register: the op name must be a non-empty identifier string like 'shard_last' "
        f"(config strings call it by that name), got {name!r}"
    )

  def decorate(factory):
    if not callable(factory):
      raise ShardingError(
          f"register({name!r}) decorates a factory function returning a rule; got "
          f"{type(factory).__name__} {factory!r}"
      )
    if name in _OPS and _OPS[name].factory is not factory:
      raise ShardingError(f"op {name!r} is already registered; pick another name")
    _check_storage_only(name, factory, storage_only)
    _OPS[name] = OpInfo(name, factory, follows, storage_only)
    return factory

  return decorate


@contextlib.contextmanager
def temporary_ops(*, follows: bool = True, **factories: Callable):
  """Registers ``factories`` (``name=factory``) for a ``with`` block, then removes them.

  Every op registered inside the block, by these keywords or by :func:`register`,
  is removed when the block ends, even on an exception; ops registered before it
  stay. Names already registered are refused, so a block never shadows an op.

  Args:
    follows: as in :func:`register`, for the keyword factories.
    **factories: op name to factory.

  Raises:
    ShardingError: a name is already registered.

  Example:
    >>> from bv_sharding.specs import place
    >>> def shard_first(axis):
    ...   return lambda leaf, spec: place(leaf, spec, 0, axis)
    >>> with temporary_ops(shard_first=shard_first):
    ...   "shard_first" in registered()
    True
    >>> "shard_first" in registered()
    False
  """
  before = set(_OPS)
  try:
    for name, factory in factories.items():
      register(name, follows=follows)(factory)
    yield
  finally:
    for name in set(_OPS) - before:
      del _OPS[name]


def _check_storage_only(name: str, factory: Callable, storage_only) -> None:
  if isinstance(storage_only, bool):
    return
  arguments = list(inspect.signature(factory).parameters)
  if not isinstance(storage_only, str) or storage_only not in arguments:
    raise ShardingError(
        f"register({name!r}, storage_only={storage_only!r}): storage_only is True, False or "
        f"the name of the factory argument listing the storage-only mesh axes, one of "
        f"{arguments}"
    )


def registered() -> tuple[str, ...]:
  """Names of all registered ops, sorted."""
  return tuple(sorted(_OPS))


def lookup(name: str) -> OpInfo:
  """The registered op ``name``; unknown names raise with the closest ones."""
  if name not in _OPS:
    raise ShardingError(
        f"unknown op {name!r}{closest(name, _OPS)} " f"Registered ops: {', '.join(registered())}."
    )
  return _OPS[name]


def parse_chain(text: str) -> tuple[Op, ...]:
  """Parses ``'op(args)|op(args)'`` into bound ops, raising ``ShardingError`` on any mistake."""
  if not isinstance(text, str):
    raise ShardingError(f"op chain must be a string like 'fsdp(axis=\"data\")', got {text!r}")
  if len(text) > MAX_CHAIN_CHARS:
    raise ShardingError(
        f"op chain {text[:60]!r}... is {len(text)} characters; "
        f"at most {MAX_CHAIN_CHARS} are accepted"
    )
  try:
    tree = ast.parse(text.strip(), mode="eval").body
    comments = [
        t
        for t in tokenize.generate_tokens(io.StringIO(text).readline)
        if t.type == tokenize.COMMENT
    ]
  except (SyntaxError, ValueError, RecursionError, MemoryError, tokenize.TokenError) as e:
    raise ShardingError(
        f"cannot parse op chain {text!r}: {e}. " "Write ops as name(arg, key=value) joined by '|'."
    ) from None
  if comments:
    raise ShardingError(
        f"op chain {text!r} has a comment {comments[0].string!r}; "
        "remove it (put notes in the config file, not in the op string)"
    )
  return tuple(_bind(call, text) for call in _split_pipes(tree, text))


def _split_pipes(node: ast.AST, text: str) -> list[ast.Call]:
  """The chain's calls, left to right; a bare name (big_vision's ``'replicate'``) is a call
  without arguments."""
  if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
    return _split_pipes(node.left, text) + _split_pipes(node.right, text)
  if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
    return [node]
  if isinstance(node, ast.Name):
    return [ast.copy_location(ast.Call(func=node, args=[], keywords=[]), node)]
  raise ShardingError(
      f"in op chain {text!r}: {_excerpt(node, text)!r} is not an op call; "
      "write ops as plain names with literal arguments, e.g. "
      "'fsdp(axis=\"data\")', joined by '|'"
  )


def _bind(call: ast.Call, text: str) -> Op:
  info = lookup(call.func.id)
  where = f"in op chain {text!r}, {_excerpt(call, text)!r}"
  args = [_literal(a, where, text) for a in call.args]
  kwargs = {}
  for kw in call.keywords:
    if kw.arg is None:
      raise ShardingError(
          f"{where}: '**' arguments are not accepted; " f"signature: {info.signature}"
      )
    if kw.arg in kwargs:
      raise ShardingError(
          f"{where}: argument {kw.arg!r} is given twice; " f"signature: {info.signature}"
      )
    kwargs[kw.arg] = _literal(kw.value, where, text)
  try:
    bound = inspect.signature(info.factory).bind(*args, **kwargs)
  except TypeError as e:
    raise ShardingError(f"{where}: {e}; signature: {info.signature}") from None
  bound.apply_defaults()
  return Op(
      info.name,
      _excerpt(call, text),
      dict(bound.arguments),
      info.factory(*bound.args, **bound.kwargs),
      info.follows,
      _storage_axes(info, bound.arguments, where),
  )


def _storage_axes(info: OpInfo, arguments: dict, where: str) -> bool | tuple[str, ...]:
  """``info.storage_only`` resolved against the bound ``arguments``: a bool, or the listed axes."""
  if isinstance(info.storage_only, bool):
    return info.storage_only
  listed = arguments[info.storage_only]
  return (
      ()
      if listed is None
      else specs.axes_of(specs.check_axis(f"{where}: {info.storage_only}", listed))
  )


def _literal(node: ast.AST, where: str, text: str):
  if isinstance(node, ast.Starred):
    raise ShardingError(f"{where}: '*' arguments are not accepted")
  try:
    value = ast.literal_eval(node)
  except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
    raise ShardingError(
        f"{where}: argument {_excerpt(node, text)!r} is not a literal; "
        "use strings, numbers, booleans, None or tuples of them"
    ) from None
  if not _plain(value):
    raise ShardingError(
        f"{where}: argument {value!r} is not accepted; "
        "use strings, numbers, booleans, None or tuples of them"
    )
  return value


def _plain(value) -> bool:
  if isinstance(value, (tuple, list)):
    return all(_plain(v) for v in value)
  return value is None or isinstance(value, (str, bool, int, float))


def _excerpt(node: ast.AST, text: str) -> str:
  return ast.get_source_segment(text.strip(), node) or ast.dump(node)[:60]
