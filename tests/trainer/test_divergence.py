"""trainers/divergence.py: a non-finite loss stops the run (or its update is skipped), in process
and through ``python -m trainers.train``."""

import json
import math

import jax.numpy as jnp
import optax
import pytest

from tests.helpers import assert_untouched, train, used_workdir
from trainers import divergence
from trainers.errors import NonFiniteLossError

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
  line = next(x for x in out.splitlines() if x.startswith("NonFiniteLossError:"))
  assert "the loss is nan" in line and "the last finite loss was" in line and "config.lr" in line
  assert f"moved config.json, metrics.jsonl into {workdir}/attempt-1 (nothing deleted)" in out
  assert_untouched(workdir / "attempt-1")
  assert records[0]["step"] == 1 and records[-1]["loss"] is None
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
