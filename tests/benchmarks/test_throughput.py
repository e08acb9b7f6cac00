"""The benchmarks time and measure the trainer's own compiled step, not one of their own."""

import hashlib
import re

import bv_sharding as bvs
from benchmarks import step_traffic, throughput
from configs import lm
from trainers import build, train

# The source locations a compiled module's text names (which differ with the caller): its
# tables of files, functions and frames, and each instruction's metadata.
LOCATIONS = re.compile(r"^(\d+ .*|FileNames|FunctionNames|FileLocations|StackFrames)$")


def fingerprint(hlo: str) -> str:
  """The sha256 of a compiled module's text without its source locations."""
  hlo = re.sub(r",? ?metadata=\{[^}]*\}", "", hlo)
  lines = [line for line in hlo.splitlines() if not LOCATIONS.match(line)]
  return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def test_a_benchmarks_compiled_step_is_the_trainers():
  config = lm.get_config()  # The tiny Llama, two microbatches a step.
  config.seq_len, config.batch_size, config.grad_accum_steps = 16, 16, 2
  run = build.build(config, bvs.make_mesh(config.mesh, axis_types=build.axis_types(config)))
  trainers = fingerprint(train.check_compiled(run).train.as_text())
  _, _, step, _ = throughput.setup(config, 1)  # benchmarks.accelerator's too
  assert fingerprint(step.train.as_text()) == trainers
  assert fingerprint(step_traffic.compile_step(config)[0]) == trainers
  config.grad_accum_steps = 1  # Another config, another step.
  assert fingerprint(throughput.setup(config, 1)[2].train.as_text()) != trainers
