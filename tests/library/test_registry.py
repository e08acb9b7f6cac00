"""Op-chain parsing: literal arguments only, one error type with a fix in every message."""

import builtins
import os
import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import bv_sharding as bvs
from benchmarks.shapes import sds


def test_parses_chain_with_positional_keyword_and_tuple_args():
  ops = bvs.parse_chain(
      'shard_dim("model", dim=-1) | fsdp(axis=("data", "model"), ' "min_size_to_shard_mb=0.5)"
  )
  assert [op.name for op in ops] == ["shard_dim", "fsdp"]
  assert ops[0].arguments == {"axis": "model", "dim": -1, "ignore_ndim_error": False}
  assert ops[1].arguments == {"axis": ("data", "model"), "min_size_to_shard_mb": 0.5}
  assert ops[0].text == 'shard_dim("model", dim=-1)'


def test_defaults_are_bound():
  (op,) = bvs.parse_chain('fsdp(axis="data")')
  assert op.arguments["min_size_to_shard_mb"] == 4


@pytest.mark.parametrize(
    "text, fragments",
    [
        ("fsdpp(axis='data')", ["unknown op 'fsdpp'", "did you mean 'fsdp'", "Registered ops:"]),
        (
            "fsdp(axis='data', size=3)",
            ["unexpected keyword argument 'size'", "fsdp(axis, min_size_to_shard_mb=4)"],
        ),
        (
            "shard_dim(axis='data')",
            ["missing a required argument: 'dim'", "shard_dim(axis, dim, ignore_ndim_error=False)"],
        ),
        ("fsdp(axis=data)", ["not a literal", "'data'"]),
        ("fsdp(axis='data'", ["cannot parse", "name(arg, key=value)"]),
        ("fsdp", ["missing a required argument: 'axis'"]),
        ("fsdp(axis='data') + replicate()", ["not an op call"]),
        ("fsdp(axis=3)", ["axis must be a mesh axis name"]),
        ("fsdp(axis=('data', 'data'))", ["names a mesh axis twice"]),
        ("fsdp(axis='data', min_size_to_shard_mb=-1)", ["must be a finite number >= 0"]),
        (
            "fsdp(axis='data', min_size_to_shard_mb=1e999)",
            ["must be a finite number >= 0, got inf"],
        ),
        ("shard_dim(axis='data', dim=1.5)", ["dim must be an integer"]),
        ("fsdp(**{'axis': 'data'})", ["'**' arguments are not accepted"]),
        ("fsdp(*['data'])", ["'*' arguments are not accepted"]),
        ("fsdp(axis={'a': 1})", ["is not accepted"]),
    ],
)
def test_errors_name_the_string_and_the_fix(text, fragments):
  with pytest.raises(bvs.ShardingError) as info:
    bvs.parse_chain(text)
  for fragment in fragments:
    assert fragment in str(info.value), str(info.value)


def test_unknown_op_error_is_a_value_error():
  with pytest.raises(ValueError):
    bvs.lookup("nope")


def shard_first(axis):
  return lambda leaf, spec: bvs.ops.place(leaf, spec, 0, axis)


def test_register_adds_an_op_and_refuses_a_second_with_the_same_name():
  with bvs.temporary_ops():
    bvs.register("test_only_shard_first")(shard_first)
    assert bvs.lookup("test_only_shard_first").factory is shard_first
    with pytest.raises(bvs.ShardingError, match="already registered"):
      bvs.register("test_only_shard_first")(lambda axis: None)
  assert "test_only_shard_first" not in bvs.registered()


def test_temporary_ops_exist_only_inside_the_block_even_on_errors():
  before = bvs.registered()
  mesh = bvs.make_abstract_mesh([("data", -1)], 8)
  tree = {"w": jax.ShapeDtypeStruct((64, 32), "float32")}
  with pytest.raises(RuntimeError, match="inside"):
    with bvs.temporary_ops(shard_first=shard_first):
      plan = bvs.plan(tree, 'shard_first(axis="data")', mesh)
      assert plan.by_name()["w"].spec == P("data", None)
      assert bvs.lookup("shard_first").follows
      raise RuntimeError("inside")
  assert bvs.registered() == before
  with pytest.raises(bvs.ShardingError, match="unknown op 'shard_first'"):
    bvs.plan(tree, 'shard_first(axis="data")', mesh)


def test_temporary_ops_refuse_a_registered_name_and_leave_it_as_it_was():
  fsdp = bvs.lookup("fsdp")
  with pytest.raises(bvs.ShardingError, match="'fsdp' is already registered"):
    with bvs.temporary_ops(fsdp=shard_first):
      pass
  assert bvs.lookup("fsdp") == fsdp


HOSTILE = [
    "__import__('os').system('touch /tmp/pwned')",
    "__import__('os')",
    "fsdp(axis=__import__('os').getcwd())",
    "fsdp(axis=open('/etc/passwd').read())",
    "os.system('x')",
    "fsdp.__class__",
    "fsdp(axis='data').__class__.__bases__",
    "(lambda: 1)()",
    "fsdp(axis=(lambda: 'data')())",
    "fsdp(axis=f'{1}')",
    "fsdp(axis=f'data')",
    "fsdp(axis='data' if True else 'model')",
    "fsdp(axis=[x for x in 'data'])",
    "fsdp(axis={x for x in 'ab'})",
    "fsdp(axis=exec('1'))",
    "fsdp(axis=eval('1'))",
    "fsdp(axis=globals())",
    "fsdp(axis=__builtins__)",
    "fsdp(axis='data', min_size_to_shard_mb=10**100000)",
    "fsdp(axis='data', min_size_to_shard_mb=9**9**9)",
    "fsdp(axis='data', min_size_to_shard_mb=" + "9" * 5000 + ")",
    "fsdp(axis='data', min_size_to_shard_mb=1e400 * 0)",
    "fsdp(axis='" + "a" * 5000 + "')",
    "(" * 500 + "fsdp(axis='data')" + ")" * 500,
    "fsdp(axis=" + "(" * 200 + "'data'" + ")" * 200 + ")",
    "fsdp(axis='data'); import os",
    "import os",
    "fsdp(axis='data')\nimport os",
    "yield 1",
    "await fsdp()",
    "fsdp(axis:='data')",
    "fsdp(axis=(a:='data'))",
    "fsdp(axis='data')[0]",
    "fsdp(axis='data')(1)",
    "fsdp()()",
    "fsdp(axis='data') or replicate()",
    "fsdp(axis='data') and replicate()",
    "fsdp(axis='data') & replicate()",
    "fsdp(axis='data') || replicate()",
    "fsdp(axis='data') | ",
    "| fsdp(axis='data')",
    "|",
    "",
    "   ",
    "()",
    "[]",
    "{}",
    "1",
    "'fsdp'",
    "None",
    "True",
    "...",
    "fsdp(...)",
    "fsdp(axis=...)",
    "fsdp(axis=b'data')",
    "fsdp(axis=1j)",
    "fsdp(axis=-'data')",
    "fsdp(axis=not 'data')",
    "fsdp(axis='da' 'ta', min_size_to_shard_mb=[1])",
    "fsdp(axis='data', min_size_to_shard_mb=True)",
    "fsdp(axis='data', min_size_to_shard_mb='1')",
    "fsdp(axis='data', min_size_to_shard_mb=None)",
    "fsdp(axis='data', min_size_to_shard_mb=float('nan'))",
    "fsdp(axis='data', axis='model')",
    "fsdp('data', axis='model')",
    "fsdp('data', 1, 2)",
    "shard_dim(axis='data', dim=True)",
    "shard_dim(axis='data', dim=None)",
    "shard_dim(axis='data', dim='0')",
    "replicate(1)",
    "replicate(axis='data')",
    "tensor_parallel()",
    "tensor_parallel(axis=None)",
    "tensor_parallel(axis=())",
    "tensor_parallel(axis=('',))",
    "logical_partitioning(rules=[])",
    "zero1()",
    "preconditioner(dim='x')",
    "preconditioner(axis=0)",
    "llm_fsdp(axis='')",
    "llm_fsdp(axis=['data', 5])",
    "FSDP(axis='data')",
    "fsdp_(axis='data')",
    "__init__()",
    "__class__()",
    "print('hello')",
    "exit()",
    "breakpoint()",
    "getattr(fsdp, 'x')",
    "fsdp(axis='data') if True else replicate()",
    "[fsdp(axis='data')]",
    "(fsdp(axis='data'),)",
    "{'fsdp': 1}",
    "fsdp(axis='data') is replicate()",
    "fsdp(axis='data') == replicate()",
    "-fsdp(axis='data')",
    "~fsdp(axis='data')",
    "fsdp(axis='data').x",
    "a.b.c()",
    "fsdp(axis='data') # comment | replicate()",
    "\x00",
    "fsdp(axis='\\x00')|unknown()",
    "async def f(): pass",
    "def f(): pass",
    "class A: pass",
    "x = 1",
    "del x",
    "assert False",
    "raise SystemExit",
    "fsdp(axis=sys.modules)",
    "fsdp(axis=().__class__.__base__.__subclasses__())",
]


def test_fuzz_hostile_strings_raise_sharding_error_and_run_nothing(monkeypatch, tmp_path):
  """Every malformed or hostile string raises ShardingError and no builtin side effect runs."""
  assert len(HOSTILE) >= 100
  called = []
  for module, name in [
      (builtins, n) for n in ("open", "exec", "eval", "print", "exit", "breakpoint")
  ] + [(os, "system")]:
    monkeypatch.setattr(module, name, lambda *a, _n=name, **k: called.append(_n))
  raised = []
  for text in HOSTILE:
    try:
      bvs.parse_chain(text)
    except bvs.ShardingError:
      raised.append(text)
  monkeypatch.undo()
  assert [t for t in HOSTILE if t not in raised] == []
  assert called == []
  assert not (tmp_path / "pwned").exists()


def test_non_string_chain_is_our_error():
  with pytest.raises(bvs.ShardingError, match="must be a string"):
    bvs.parse_chain(["fsdp(axis='data')"])


_MESH = bvs.make_abstract_mesh([("data", 4), ("model", 2)], 8)
_W = {"w": jax.ShapeDtypeStruct((6, 8), jnp.float32), "b": jax.ShapeDtypeStruct((8,), jnp.float32)}
_MISTAKES = [  # (what the user passed, the call that raises)
    *[
        (text, lambda t=text: bvs.parse_chain(t))
        for text in [
            "fsdpp(axis='data')",
            "fsdp(axis='data', size=3)",
            "fsdp",
            "replicate(axis='data')",
            "shard_dim(axis='data')",
            "shard_dim('model', 0, ignore_ndim_error='yes')",
            "fsdp(axis=data)",
            "fsdp(axis='data'",
            "fsdp(axis='data') + replicate()",
            "fsdp(axis=3)",
            "fsdp(axis='data') # note",
            "fsdp(**{'axis': 'data'})",
            "preconditioner(dim='rows')",
            "zero1",
            42,
        ]
    ],
    *[
        (strategy, lambda s=strategy: bvs.plan(_W, s, _MESH))
        for strategy in [
            [("(", "replicate")],
            [(1, "replicate")],
            5,
            [(".*", 'fsdp(axis="tensor")')],
            [(".*", 'shard_dim(axis="model", dim=-2)')],
        ]
    ],
    *[
        (rules, lambda r=rules: bvs.plan(_W, "logical_partitioning()", _MESH, rules=r))
        for rules in ["data", [(1, "data")], [("embed", "tensor")], [("embed", 3)]]
    ],
    ("strict", lambda: bvs.plan(_W, 'shard_dim(axis="data", dim=0)', _MESH, strict=True)),
]


def _strings(given) -> list[str]:
  if isinstance(given, str):
    return [given, repr(given)]
  if isinstance(given, (list, tuple)):
    return [t for g in given for t in _strings(g)]
  return [str(given)]


def _suggested_calls(message: str, given) -> list[str]:
  """Op calls a message proposes: each balanced `op(...)` of a registered op that is not
  an echo of what the user passed."""
  message = message.split("signature: ")[0]  # the factory's Python signature, not a call
  for echo in sorted(_strings(given), key=len, reverse=True):
    message = message.replace(echo, " " * len(echo))
  calls = []
  ops = "|".join(bvs.registered())
  for match in re.finditer(rf"\b({ops})\(", message):
    depth = 0
    for end in range(match.end() - 1, len(message)):
      depth += {"(": 1, ")": -1}.get(message[end], 0)
      if depth == 0:
        calls.append(message[match.start() : end + 1])
        break
  return calls


def test_every_fix_an_error_message_proposes_parses_and_binds():
  proposed = []
  for given, make_mistake in _MISTAKES:
    with pytest.raises(bvs.Error) as info:
      make_mistake()
    for call in _suggested_calls(str(info.value), given):
      proposed.append(call)
      bvs.parse_chain(call)  # raises if the proposed fix is not a valid call
  assert 'fsdp(axis="data")' in proposed
  assert "shard_dim(axis='model', dim=-2, ignore_ndim_error=True)" in proposed


@pytest.mark.parametrize("name", ["", 3, None, "two words", ("fsdp",)])
def test_register_needs_an_identifier_name(name):
  with pytest.raises(bvs.ShardingError, match=r"register: the op name"):
    bvs.register(name)
  with pytest.raises(bvs.ShardingError, match=r"unknown op 'nope'"):
    bvs.lookup("nope")  # The registry is intact: unknown ops stay our error.


@pytest.mark.parametrize("factory", [3, "fsdp", None])
def test_register_needs_a_callable(factory):
  with pytest.raises(bvs.ShardingError, match=r"register\('test_only_never'\) decorates"):
    bvs.register("test_only_never")(factory)
  assert "test_only_never" not in bvs.registered()


@pytest.fixture
def returns_op():
  """``test_only_returns(result)``, a rule returning ``result`` as given in the strategy string,
  registered for one test."""

  def returns(result):
    return lambda leaf, spec: result

  with bvs.temporary_ops(test_only_returns=returns):
    yield


@pytest.mark.parametrize(
    "result",
    [
        '("data",)',  # A spec, not (spec, note).
        '((None,), "n")',  # One entry for a 2-d leaf.
        '((None, "nope"), "n")',  # No such mesh axis.
        '(("data", "data"), "n")',  # An axis twice.
        '(("model", ("data", "model")), "n")',  # An axis twice, in a tuple.
        '((None, "data"), "n")',  # 6 is not divisible by 4.
        "((None, None), 3)",  # The note is not a string.
        '(((1,), None), "n")',  # An axis that is not a name.
        "None",
    ],
)
def test_malformed_rule_output_names_the_op(returns_op, result):
  with pytest.raises(bvs.ShardingError, match=r"op 'test_only_returns' on leaf 'w' \(8, 6\)"):
    bvs.plan({"w": sds(8, 6)}, f"test_only_returns({result})", _MESH)


def test_well_formed_rule_output_is_used(returns_op):
  plan = bvs.plan({"w": sds(8, 6)}, 'test_only_returns((("data", "model"), "mine"))', _MESH)
  assert plan.entries[0].spec == jax.sharding.PartitionSpec("data", "model")
