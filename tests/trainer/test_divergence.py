"""trainers/hooks/divergence.py: a non-finite loss stops the run (or its update is skipped), in process
and through ``python -m trainers.train``."""

import json
import math

import jax.numpy as jnp
import optax
import pytest

from tests.helpers import assert_untouched, train, used_workdir
from trainers.errors import NonFiniteLossError
from trainers.hooks import divergence

SHORT = (
    "--config.total_steps=6",
    "--config.schedule.warmup_steps=2",
    "--config.batch_size=16",
    "--config.seq_len=32",
    "--config.log_every=2",
    "--config.eval_every=6",
    "--config.eval_batches=1",
)


def test_diverging_run_stops_with_valid_metrics_and_keeps_the_earlier_run(tmp_path):
  """lr=1e9 trained to the end with loss=nan and wrote bare NaN; now it stops, exit 1.

  The workdir held an earlier run: its files move to attempt-1/, byte-identical. The
  optimizer's keyword arguments come from the command line (--config.optax.b1).
  """
  workdir = used_workdir(tmp_path / "run")
  status, out, records = train(workdir, *SHORT, "--config.lr=1e9", "--config.optax.b1=0.5")
  assert status == 1, out[-3000:]
  # The update of step 3 overflows the params (their norm inf) while its loss is finite: the
  # run stops there, before a later step's loss turns nan or a checkpoint saves them.
  line = next(x for x in out.splitlines() if x.startswith("NonFiniteLossError:"))
  assert "step 3: the loss was" in line and "the updated params are not finite" in line
  assert "config.lr (now 1000000000.0)" in line
  assert f"moved config.json, metrics.jsonl into {workdir}/attempt-1 (nothing deleted)" in out
  assert_untouched(workdir / "attempt-1")
  assert records[0]["step"] == 1 and records[-1]["l2_params"] is None
  assert records[-1]["stopped"] in line
  assert "NaN" not in (workdir / "metrics.jsonl").read_text()
  assert json.loads((workdir / "config.json").read_text())["optax"] == {"b1": 0.5}


def test_skip_policy_skips_nonfinite_updates_with_real_optax():
  tx = divergence.guard(optax.sgd(0.1), "skip")
  params = {"w": jnp.ones(2)}
  state = tx.init(params)
  updates, state = tx.update({"w": params["w"] * math.nan}, state, params)
  assert float(abs(updates["w"]).sum()) == 0.0
  updates, state = tx.update({"w": params["w"]}, state, params)
  assert float(abs(updates["w"]).sum()) > 0.0
  plain = optax.sgd(0.1)
  assert divergence.guard(plain, "stop") is plain


def test_loss_watch_policies():
  written = []
  stop = divergence.LossWatch("stop", lr=3.0, write=written.append)
  assert stop.observe(1, 2.5) and stop.observe(2, 2.0)
  with pytest.raises(NonFiniteLossError, match="step 3: .* last finite loss was 2 at step 2"):
    stop.observe(3, math.inf)
  assert written == [{"step": 3, "loss": math.inf, "stopped": written[0]["stopped"]}]
  skip = divergence.LossWatch("skip", lr=3.0)
  assert [skip.observe(s, math.nan) for s in range(1, divergence.MAX_SKIPPED)] == [False] * (
      divergence.MAX_SKIPPED - 1
  )
  with pytest.raises(NonFiniteLossError, match="no step had a finite loss"):
    skip.observe(divergence.MAX_SKIPPED, math.nan)


@pytest.mark.parametrize("policy", ["stop", "skip"])
def test_params_made_non_finite_by_a_finite_loss_step_stop_the_run(policy):
  # Adam with b1=1 divides by 1 - b1**t = 0: the loss was finite, the params it left are not.
  written = []
  watch = divergence.LossWatch(policy, lr=3.0, write=written.append)
  assert watch.observe(1, 2.5, l2_params=10.0)
  with pytest.raises(NonFiniteLossError, match="step 2: the loss was 2.4 but the updated params"):
    watch.observe(2, 2.4, l2_params=math.nan)
  assert written[0]["step"] == 2 and "config.optax" in written[0]["stopped"]
  assert written[0]["loss"] == 2.4
