r"""Samples text from a run's latest checkpoint: what the trained language model writes.

  python -m trainers.sample --workdir runs/own --prompt "Once upon a time"
  python -m trainers.sample --workdir runs/own --prompt "def " --max_new_tokens 200 \
      --temperature 0.8 --top_k 40 --devices_per_process 2
  python -m trainers.sample --workdir gs://my-bucket/runs/lm --prompt "Once"

The run is built from ``W/config.json`` exactly as the trainer builds it (trainers/build.py:
task, model, one plan) on this host's devices, which need not be the ones it trained on (on
CPU, ``--devices_per_process`` simulated ones), and the latest checkpoint's params are
restored onto that plan, sharded (``checkpoint.load_params``, as ``config.model_init`` does),
and checked as a resume checks them (``checkpoint.check_sums``): a step that does not check out
is named in the log and the newest one that does is sampled.
The prompt is encoded, and decoded with the continuation, by the tokenizer recorded beside the
run's token files (trainers/input/tokenizer.py; bytes for ``kind="text"`` and byte-level
files); generation stops at the end-of-text id or after ``--max_new_tokens``.

Generation keeps a KV cache (the Llama's ``decode`` mode): the prompt is run once, then each
new token is one position's forward pass attending to the cached ones. The window is the
trained one (``config.seq_len``, at most the model's ``max_len``): when the cache is full, it is
refilled from the last half window of tokens (one pass of ``seq_len / 2`` positions every
``seq_len / 2`` new tokens), so the model never sees a position it was not trained on.
``--temperature 0`` picks the most likely token; ``--top_k K`` samples among the K likeliest. A bad input (no
checkpoint, a missing tokenizer) ends as one line, ``ConfigError: ...``, exit status 1.
"""

import os

from trainers import ONE_BLAS_THREAD

os.environ.setdefault(*ONE_BLAS_THREAD)  # Before numpy loads OpenBLAS (trainers/__init__.py).

import json
import sys

import jax
import ml_collections
import numpy as np

import bv_sharding as bvs
from trainers import build
from trainers.errors import ConfigError
from trainers.hosts import distributed
from trainers.input import records, sources
from trainers.input import tokenizer as tokenizers_lib
from trainers.rundir import checkpoint, paths, workdir
from trainers.settings import cli, schema


def run_config(path: str) -> ml_collections.ConfigDict:
  """The config a trainer wrote into workdir ``path`` (``config.json``; a local path or a
  ``gs://`` URL, trainers/rundir/paths.py), its lists as tuples."""
  name = paths.path(path) / workdir.CONFIG
  if not name.is_file():
    raise ConfigError(f"--workdir={path} has no {workdir.CONFIG}; name a trainer's workdir")
  try:
    config = json.loads(name.read_text())
  except (UnicodeDecodeError, json.JSONDecodeError) as e:
    config = e
  if not isinstance(config, dict):
    raise ConfigError(
        f"--workdir={path}: {workdir.CONFIG} is not a JSON object of config keys "
        f"({type(config).__name__}); put back the one the trainer wrote, or name another workdir"
    )
  return ml_collections.ConfigDict(_tuples(config))


def _tuples(value):
  if isinstance(value, list):
    return tuple(_tuples(v) for v in value)
  if isinstance(value, dict):
    return {k: _tuples(v) for k, v in value.items()}
  return value


def run_tokenizer(config) -> tuple:
  """(tokenizer or None for bytes, end-of-text id or None, ids it has) of the run's token files."""
  spec = sources.input_spec(config.input)
  record, name = records.recorded(spec) if spec.kind == "tokens" else ({}, "")
  path = record.get("tokenizer")
  if path and not os.path.isfile(path):
    raise ConfigError(
        f"{name}.json names tokenizer {path}, which does not exist; put it back (or convert "
        "the corpus again)"
    )
  if path and record.get("tokenizer_sha256") not in (None, tokenizers_lib.sha256(path)):
    raise ConfigError(
        f"{path} is not the tokenizer {name} was made with (its sha256 differs from the one "
        f"{name}.json records): its ids would decode to other text; put the original back (or "
        "convert the corpus again)"
    )
  tok = tokenizers_lib.load(path)
  return tok, record.get("eot_id"), record.get("vocab_size", tokenizers_lib.BYTE_VOCAB)


def pick(logits: np.ndarray, rng: np.random.Generator, temperature: float, top_k: int) -> int:
  """The next token from ``logits``: the argmax at temperature 0, else sampled (top ``k``).

  Example:
    >>> pick(np.array([0.0, 3.0, 1.0]), np.random.default_rng(0), 0.0, 0)
    1
    >>> pick(np.array([0.0, 3.0, 1.0]), np.random.default_rng(0), 1.0, 1)
    1
    >>> pick(np.array([0.0, 3.0, 1.0]), np.random.default_rng(0), 1.0, 1_000_000) in (0, 1, 2)
    True
  """
  if temperature <= 0:
    return int(np.argmax(logits))
  scaled = logits.astype(np.float64) / temperature
  if 0 < top_k < len(scaled):  # A k of the vocabulary's size or more keeps every token.
    scaled[scaled < np.sort(scaled)[-top_k]] = -np.inf
  p = np.exp(scaled - scaled.max())
  return int(rng.choice(len(p), p=p / p.sum()))


def finite(logits: np.ndarray, source: str) -> np.ndarray:
  """``logits``, or ``ConfigError`` if any is NaN or infinite (params of a diverged run)."""
  if not np.all(np.isfinite(logits)):
    raise ConfigError(
        f"{source} gives non-finite logits (its params hold NaN or inf: the run diverged); "
        "sample a checkpoint saved before it did"
    )
  return logits


def decode_step(model, plan: bvs.Plan):
  """``step(params, cache, tokens) -> (last logits, cache)``: ``tokens`` (1, T) continue the
  sequence ``cache`` holds ({}: none yet), jitted; params gathered to their compute specs as
  the trainer's loss gathers them (``build.gathering``)."""
  gather, decoder = build.gathering(model.clone(decode=True), plan)

  def step(params, cache, tokens):
    logits, cache = decoder.apply({"params": gather(params), **cache}, tokens, mutable=["cache"])
    return logits[0, -1], cache

  return jax.jit(step)


def generate(step, params, prompt: list[int], window: int, steps: int, choose, eot) -> list[int]:
  """Up to ``steps`` tokens continuing ``prompt``, each ``choose(logits)``; stops after ``eot``.

  The cache holds at most ``window`` tokens; when full it is refilled with the last
  ``window // 2``.
  """
  context = list(prompt[-window:])
  logits, cache = step(params, {}, np.array([context], np.int32))
  new, filled = [], len(context)
  while len(new) < steps:
    new.append(choose(np.asarray(logits)))
    if new[-1] == eot or len(new) == steps:
      break
    if filled == window:  # Full: refill from the last half window.
      recent = (context + new)[-(window // 2) :]
      logits, cache = step(params, {}, np.array([recent], np.int32))
      filled = len(recent)
    else:
      logits, cache = step(params, cache, np.array([new[-1:]], np.int32))
      filled += 1
  return new


@cli.command
def main(argv=None) -> None:
  """``python -m trainers.sample --workdir W --prompt TEXT``: prints the prompt's continuation."""
  parser = cli.Parser("python -m trainers.sample", __doc__)
  parser.add_argument("--workdir", required=True, help="a trainer's workdir (its checkpoints)")
  parser.add_argument("--prompt", default="", help="the text to continue")
  parser.add_argument("--max_new_tokens", type=cli.at_least(1), default=100)
  parser.add_argument("--temperature", type=cli.non_negative, default=0.8, help="0: greedy")
  parser.add_argument(
      "--top_k", type=cli.at_least(0), default=0, help="sample among the K likeliest (0: all)"
  )
  parser.add_argument("--seed", type=cli.at_least(0), default=0)
  parser.add_argument(
      "--devices_per_process",
      type=cli.at_least(1),
      default=distributed.simulated_devices(),
      help="simulated CPU devices (GPU/TPU backends ignore it)",
  )
  args = parser.parse_args(argv)
  if paths.is_url(args.workdir):
    paths.check(args.workdir)
  config = schema.of(run_config(args.workdir))  # build() resolves the files' vocab, dtype.
  if not (paths.path(args.workdir) / checkpoint.CHECKPOINTS).is_dir():
    raise ConfigError(f"--workdir={args.workdir} has no checkpoints/; train it first")
  tok, eot, vocab = run_tokenizer(config)
  prompt = tokenizers_lib.encode(tok, [args.prompt], [False], None).tolist()
  if not prompt:
    if eot is None:
      raise ConfigError("--prompt is empty and bytes have no end-of-text id to start from")
    prompt = [eot]  # A new document.
  jax.config.update("jax_num_cpu_devices", args.devices_per_process)
  mesh = bvs.make_mesh(config.mesh, dcn_mesh=config.dcn_mesh, axis_types=config.mesh_axis_types)
  run = build.build(config, mesh)
  checkpoint.quiet_orbax()
  with jax.set_mesh(mesh):
    params, source = checkpoint.load_params(args.workdir, run.plan)
    print(f"sampling from {source} on {jax.device_count()} devices", file=sys.stderr)
    step = decode_step(run.model, run.plan)
    rng = np.random.default_rng(args.seed)
    choose = lambda logits: pick(finite(logits[:vocab], source), rng, args.temperature, args.top_k)
    window = min(config.seq_len, run.model.config.max_len)
    new = generate(step, params, prompt, window, args.max_new_tokens, choose, eot)
  print(args.prompt + tokenizers_lib.decode(tok, new))


if __name__ == "__main__":
  main()
