"""`python -m trainers.plan` on the pod-scale config (Llama 7B, 256 abstract devices), in process.

Totals are checked against sums computed here from each leaf's shape and spec,
and for AdamW against the 7B parameter count worked out by hand.
"""

import contextlib
import io
import json
import math
import re

import matplotlib.pyplot as plt
import numpy as np
import pytest

from tests.helpers import COMPILED_LM, assert_snake_case_help, run_module
from trainers import MiB
from trainers import plan as command

MESH = '[("data", 64), ("model", 4)]'
POD = ("--config", "configs/lm_7b_pod.py", "--mesh", MESH)
TINY = ("--config", "configs/lm.py", *COMPILED_LM)  # 32 x 64 tokens, 8 simulated devices.
V, D, L, F = 32_000, 4096, 32, 11_008  # Llama 7B: vocab, width, layers, MLP width.


def run(*args, pod=POD):
  """(exit status, stdout, stderr) of the command's main."""
  out, err = io.StringIO(), io.StringIO()
  with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    try:
      status = command.main([*pod, *args])
    except SystemExit as e:
      status = e.code
  return status, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def reports():
  result = {}
  for name in ("adamw", "kron", "shampoo"):
    status, out, _ = run(f"--config.optax_name={name}", "--format=json")
    assert status == 0
    result[name] = json.loads(out)
  return result


def per_device(row, mesh):
  pieces = math.prod(mesh[a] for e in row["spec"] if e for a in ([e] if isinstance(e, str) else e))
  return math.prod(row["shape"]) * np.dtype(row["dtype"]).itemsize // pieces


@pytest.mark.timeout(300)
@pytest.mark.parametrize("optimizer", ["adamw", "kron", "shampoo"])
def test_totals_match_sums_of_shapes_and_specs(reports, optimizer):
  rep = reports[optimizer]
  assert rep["mesh"] == {"data": 64, "model": 4} and rep["num_devices"] == 256
  sums = {"params": 0, "optimizer_state": 0}
  for row in rep["leaves"]:
    assert row["bytes_per_device"] == per_device(row, rep["mesh"]), row["name"]
    sums[row["component"]] += per_device(row, rep["mesh"])
  totals = rep["per_device"]
  assert totals["params"] == totals["gradients"] == sums["params"]
  assert totals["optimizer_state"] == sums["optimizer_state"]
  assert totals["total"] == 2 * sums["params"] + sums["optimizer_state"]
  assert rep["largest"]["bytes_per_device"] == max(r["bytes_per_device"] for r in rep["leaves"])
  n_params = 2 * V * D + L * (4 * D * D + 3 * D * F + 2 * D) + D
  param_bytes = sum(r["bytes"] for r in rep["leaves"] if r["component"] == "params")
  assert param_bytes == 4 * n_params
  unsharded = [r["unsharded_bytes"] for r in rep["leaves"]]
  assert unsharded == sorted(unsharded, reverse=True)  # Largest unsharded first.


def test_adamw_totals_by_hand(reports):
  """Kernels, the embedding and lm_head split 256 ways, norm scales whole."""
  rep = reports["adamw"]
  params = (2 * V * D + L * (4 * D * D + 3 * D * F)) * 4 // 256 + (2 * L + 1) * D * 4
  assert rep["per_device"]["params"] == params
  scalars = sum(r["bytes"] for r in rep["leaves"] if not r["shape"])
  assert rep["per_device"]["optimizer_state"] == 2 * params + scalars
  unsharded = ((2 * L + 1) * D * 4 * 3 + scalars) * (1 - 1 / 256)  # Whole on every device.
  everything = sum(r["bytes"] for r in rep["leaves"])
  assert rep["unsharded_fraction"] == pytest.approx(unsharded / everything)
  assert rep["unused_strategy_entries"] == [] and rep["unclaimed_leaves"] == []


def test_text_is_the_json_as_a_table(reports):
  status, out, _ = run("--config.optax_name=kron", "--rows=3")
  assert status == 0
  lines = out.splitlines()
  rep = reports["kron"]
  assert lines[0].split()[:6] == ["name", "shape", "dtype", "spec", "compute_spec", "MiB/device"]
  assert [line.split()[0] for line in lines[1:4]] == [r["name"] for r in rep["leaves"][:3]]
  assert f"... {len(rep['leaves']) - 3} more leaves (--rows)" in out
  d = rep["per_device"]
  assert f"optimizer state {d['optimizer_state'] / MiB:.1f} MiB" in out
  assert f"largest per-device tensor: {rep['largest']['name']}" in out
  assert "strategy entries that claimed no leaf: none" in out


def test_compute_specs_gather_the_fsdp_axis_and_keep_the_tensor_parallel_one(reports):
  """``tensor_parallel(axis="model")|llm_fsdp(axis="data")``: params are used over ``model``
  only; optimizer state is never gathered."""
  rows = reports["adamw"]["leaves"]
  for row in rows:
    kept = [None if a == "data" else a for a in row["spec"]]
    assert row["compute_spec"] == (kept if row["component"] == "params" else row["spec"])
  q = next(r for r in rows if r["name"].endswith("q_kernel") and r["component"] == "params")
  assert sorted(filter(None, q["spec"])) == ["data", "model"]
  assert list(filter(None, q["compute_spec"])) == ["model"]
  assert q["why"].endswith("; gathered for compute: data")


@pytest.mark.parametrize("limit, status", [("0.0001", 0), ("0.00001", 1)])
def test_coverage_gate_exit_status(limit, status):
  # AdamW leaves 0.00394% unsharded: the norm scales and their moments, whole on every device.
  got, _, err = run("--format=json", f"--max_unsharded_fraction={limit}")
  assert got == status
  if status:
    assert "coverage gate failed" in err and "0.00394% of the planned bytes" in err
    named = err.split("Largest unsharded leaves: ")[1].split(". Shard them")[0]
    assert len(named.split("; ")) == 5 and "params/layers/attention_norm/scale" in named


def test_png(tmp_path):
  path = tmp_path / "plan.png"
  status, _, _ = run("--config.optax_name=kron", "--rows=0", f"--png={path}")
  assert status == 0 and path.stat().st_size > 1000
  image = plt.imread(path)
  assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 300


def test_diff_optimizers_prints_only_what_changes():
  status, out, _ = run("--diff", "config.optax_name=kron")
  assert status == 0
  lines = out.splitlines()
  assert lines[0].startswith("A: --config configs/lm_7b_pod.py")
  assert "optimizer: adamw -> kron" in out
  assert any(line.startswith("+ opt/1/0/Qs_preconditioners/") for line in lines)
  assert any(line.startswith("- opt/1/0/nu/") for line in lines)
  assert not any(
      "params/" in line.split(" ")[1] for line in lines if line[:2] in ("~ ", "- ", "+ ")
  )
  assert "params MiB/device" not in out and "optimizer state MiB/device" in out


def test_diff_executes_the_config_file_once(tmp_path):
  """Both sides of --diff come from one load of the file, each with its own overrides."""
  count = tmp_path / "count"
  path = tmp_path / "counted.py"
  path.write_text(
      f"with open({str(count)!r}, 'a') as f:\n  f.write('executed\\n')\n"
      "from configs.lm_7b_pod import get_config  # noqa: F401\n"
  )
  status, out, _ = run("--diff", "config.optax_name=kron", pod=("--config", str(path)))
  assert status == 0 and "optimizer: adamw -> kron" in out
  assert count.read_text().splitlines() == ["executed"]


def test_diff_meshes():
  status, out, _ = run("--format=json", '--diff=--mesh=[("data", 32), ("model", 8)]')
  assert status == 0
  d = json.loads(out)
  assert d["summary"]["mesh"] == [{"data": 64, "model": 4}, {"data": 32, "model": 8}]
  changed = {c["name"]: c for c in d["changed"]}
  assert d["only_a"] == d["only_b"] == []
  # Every leaf is split over the whole mesh or whole on every device, either way.
  assert changed == {}
  status, out, _ = run("--diff", f"mesh={MESH}")
  assert out.splitlines()[2:] == ["0 leaves changed, 0 only in A, 0 only in B"]


def test_num_devices_sizes_the_minus_one_axis():
  status, out, err = run(
      "--format=json", "--mesh", '[("data", -1), ("model", 4)]', "--num_devices=512"
  )
  assert status == 0 and json.loads(out)["mesh"] == {"data": 128, "model": 4} and err == ""
  status, out, _ = run("--format=json", "--mesh", '[("data", -1), ("model", 4)]')
  assert status == 0 and json.loads(out)["num_devices"] == 256  # config.num_devices


def test_multi_slice_mesh_plans_on_ici_times_dcn():
  status, out, _ = run("--format=json", "--dcn_mesh", '[("data", 2)]', "--mesh", MESH, "--rows=0")
  assert status == 0
  assert json.loads(out)["mesh"] == {"data": 128, "model": 4}


def test_dashed_spellings_of_before_still_work_with_a_note():
  status, out, err = run(
      "--format=json", "--dcn-mesh", '[("data", 2)]', "--num-devices=512", "--rows=0"
  )
  assert status == 0 and json.loads(out)["mesh"] == {"data": 128, "model": 4}
  assert err.splitlines() == [
      "--dcn-mesh is deprecated: use --dcn_mesh",
      "--num-devices is deprecated: use --num_devices",
  ]


def test_help_shows_snake_case_flags_only():
  status, out, _ = run("--help")
  assert status == 0, out
  assert_snake_case_help(out, "--num_devices", "--max_unsharded_fraction", "--dcn_mesh")


@pytest.mark.parametrize(
    "args, fragment",
    [
        (("--mesh", "[('data', 64), ('model', 4)"), "is not a literal list"),
        (("--mesh", '[("data", 3), ("model", 4)]', "--num_devices=256"), "covers 12 devices"),
        (("--mesh", '["data", 64]'), "list of (axis_name, size) pairs"),
        (("--config.optax_name=adamww",), "config.optax_name='adamww' is neither"),
        (("--config.nope=1",), "has no key config.nope"),
        (("--num_devices=many",), "argument --num_devices: invalid int value: 'many'"),
        (("--max_unsharded_fraction=2",), "'2' is not a fraction in [0, 1]"),
        (("--format=xml",), "argument --format: invalid choice: 'xml'"),
    ],
)
def test_bad_input_is_one_line_and_exit_1_naming_it(args, fragment):
  status, out, err = run(*args)
  assert status == 1 and out == "" and fragment in err, err
  assert len(err.splitlines()) == 1 and re.match(r"(Config|Optimizer|Sharding)Error: ", err), err


def test_bad_config_path_is_one_config_error_line():
  status, _, err = run(pod=("--config", "configs/lm_7b_pods.py"))
  assert status == 1 and err == (
      "ConfigError: --config=configs/lm_7b_pods.py: file 'configs/lm_7b_pods.py' not found; "
      "did you mean 'lm_7b_pod.py'?\n"
  )


@pytest.mark.timeout(300)
def test_compile_prints_the_steps_memory_falling_with_microbatches():
  """configs/lm.py's tiny Llama compiled on the 8 simulated devices: XLA's figures per device,
  the arguments the plan's state and a device's rows of the batch, the temporaries (the
  activations) falling with 4 microbatches, each checked against config.device_memory_gib
  as the trainer checks it (tests/trainer/test_validation.py); the model FLOPs the same."""
  reports = {}
  for count in (1, 4):
    args = ("--compile", "--format=json", f"--config.grad_accum_steps={count}")
    status, out, _ = run(*args, "--config.device_memory_gib=0.008", pod=TINY)
    assert status == 0
    reports[count] = json.loads(out)
  one, four = reports[1]["compiled"], reports[4]["compiled"]
  planned = reports[1]["per_device"]
  rows = 32 * 65 * 4 // 8  # int32 tokens: 32 sequences of 64 + 1 over 8 devices.
  want = planned["params"] + planned["optimizer_state"] + rows
  assert one["per_device"]["arguments"] == four["per_device"]["arguments"] == want
  assert four["per_device"]["temporaries"] < 0.6 * one["per_device"]["temporaries"]
  assert four["per_device"]["total"] < one["per_device"]["total"]
  for c in (one, four):
    d = c["per_device"]
    assert d["total"] == d["arguments"] + d["temporaries"] + d["outputs"] - d["aliased"]
    assert c["devices"] == "8 cpu" and c["device_memory"] == round(0.008 * 2**30)
    assert c["where"] == "config.device_memory_gib=0.008"
  assert (one["fits"], four["fits"]) == (False, True)
  # Model FLOPs, by hand: 2 layers of 4 d^2 + 3 d d_ff, the lm head d x 256, and attention
  # 4 T d a layer (scores and values) per token, 3 x forward, once per microbatch.
  d, tokens = 128, 32 * 64
  per_token = 2 * (2 * (4 * d * d + 3 * d * 384) + d * 256) + 2 * 4 * 64 * d
  assert one["flops_per_step"] == four["flops_per_step"] == 3 * per_token * tokens
  flops_line, line = command.text(reports[1]).splitlines()[-2:]
  assert flops_line == f"model FLOPs per step: {3 * per_token * tokens:.6g} (jaxpr)"
  assert line.startswith("compiled train step on 8 cpu (grad_accum_steps=1): arguments 0.7 MiB, ")
  assert line.endswith(
      f"total {one['per_device']['total'] / MiB:.1f} MiB per device of 8.2 MiB "
      "(config.device_memory_gib=0.008): does NOT fit"
  )


def test_compile_needs_the_meshs_devices():
  status, out, err = run("--compile", "--num_devices=16", pod=TINY)
  assert status == 1 and out == "", err
  assert err.startswith(
      "ConfigError: --compile: the mesh [('data', -1)] needs 16 devices but this host has 8 (cpu;"
  )


@pytest.mark.timeout(120)
def test_trainer_refuses_a_plan_over_config_max_unsharded_fraction(tmp_path):
  """The same gate from the config: the trainer stops before allocating anything."""
  done = run_module(
      "trainers.train",
      "--config=configs/lm.py",
      f"--workdir={tmp_path}",
      "--config.max_unsharded_fraction=0.0001",
      "--config.batch_size=16",
      "--config.seq_len=64",
      timeout=110,
  )
  out = done.stdout + done.stderr
  assert done.returncode != 0
  assert "more than max_unsharded_fraction=0.0001" in out and "Largest unsharded leaves" in out
  assert "initialising params" not in out
