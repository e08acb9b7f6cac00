"""trainers/loop.py's loop, driven in process by a recording step: no host sync between log
steps, and the non-finite policy at the exact step."""

import math
import types

import ml_collections
import numpy as np
import pytest

from trainers import loop, start
from trainers.errors import NonFiniteLossError
from trainers.figures import utilization
from trainers.hooks import divergence, metrics


class Value:
  """A step's device scalar: reading it (as ``jax.device_get`` does) is recorded."""

  def __init__(self, events: list, step: int, value: float):
    self.events, self.step, self.value = events, step, value

  def __array__(self, dtype=None, copy=None):
    self.events.append(("read", self.step))
    return np.asarray(self.value, dtype=dtype)


class Run:
  """A recording train step whose loss is ``losses[step]`` (default 2.0), and its checkpoints
  (a hook as the trainer's checkpointer is: every step, and at the end)."""

  def __init__(self, losses=None, ckpt_steps=(), total=12, log_every=4, policy="stop"):
    self.events, self.losses, self.saved, self.records = [], losses or {}, [], []
    self.ckpt_steps, self.total = set(ckpt_steps), total
    config = ml_collections.ConfigDict(
        dict(log_every=log_every, eval_every=1000, total_steps=total, batch_size=2)
    )
    log = metrics.StepLog(
        config,
        types.SimpleNamespace(unit="tokens", per_example=8, bytes_per_token=None),
        {},
        start.Start(0, "scratch"),
        evaluate=lambda params: float(params),
        write=self.records.append,
        cost=utilization.StepCost(1e9, "jaxpr", 8, None),
    )
    watch = divergence.LossWatch(policy, lr=1e-3, write=self.records.append)
    plan = types.SimpleNamespace(mismatches=lambda state: [])
    self.loop = loop.Loop(self.step, watch, plan, config)
    self.loop.add_hook(self.loop.pending.evaluate, every=config.eval_every, name="eval")
    self.loop.add_hook(name="metrics", every=log_every, read=log)
    self.loop.add_checkpointer(self)

  def step(self, state, batch):
    self.events.append(("dispatch", batch))
    loss = self.losses.get(batch, 2.0)
    metrics = {k: Value(self.events, batch, loss) for k in ("loss", "l2_grads")}
    return {"params": 0.5}, metrics | {"l2_params": 1.0, "l2_updates": 0.1}

  def step_done(self, step, state, before_save=lambda: None):
    if step in self.ckpt_steps:
      before_save()
      self.saved.append(step)
    return False

  def close(self, state, before_save=lambda: None):
    before_save()
    self.saved.append("end")

  def __call__(self):
    steps = range(1, self.total + 1)
    self.loop.run({"params": 0.0}, zip(steps, steps))


def test_step_k_plus_1_is_dispatched_before_step_k_is_read():
  run = Run(total=12, log_every=4, ckpt_steps=(6,))
  run()
  order = run.events
  reads = sorted({step for kind, step in order if kind == "read"})
  assert reads == list(range(1, 13))  # Every step's loss is read once, in order ...
  for step in range(1, 12):
    first_read = order.index(("read", step))
    assert order.index(("dispatch", step + 1)) < first_read or step == 6, (step, order)
  # ... together, at log steps (1, 4, 8, read after the next dispatch), the save at 6 and the
  # end (12): one device_get each, so reads come in five runs between dispatches.
  runs = [i for i, (kind, _) in enumerate(order) if kind == "read" and order[i - 1][0] != "read"]
  assert [order[i][1] for i in runs] == [1, 2, 5, 7, 9]
  assert order[order.index(("dispatch", 6)) + 1] == ("read", 5)  # Save at 6: read 5, 6 first.
  assert [r["step"] for r in run.records] == [1, 4, 8, 12] and run.saved == [6, "end"]
  assert run.records[-1]["eval_loss"] == 0.5 and run.records[0]["tflops_per_device"] > 0


def test_stop_reports_the_first_nonfinite_step_and_saves_nothing_from_it():
  run = Run(losses={6: 1.5, 7: math.nan, 8: math.inf, 9: math.nan}, ckpt_steps=(8,))
  with pytest.raises(NonFiniteLossError, match="step 7: .* last finite loss was 1.5 at step 6"):
    run()
  assert run.saved == []  # The save at 8 read the losses first.
  assert [r["step"] for r in run.records] == [1, 4, 7]
  assert math.isnan(run.records[-1]["loss"]) and "stopped" in run.records[-1]
  assert ("dispatch", 9) not in run.events


def test_skip_counts_nonfinite_steps_in_a_row_as_before():
  nan_steps = range(3, 3 + divergence.MAX_SKIPPED)
  run = Run(losses=dict.fromkeys(nan_steps, math.nan), total=20, policy="skip", ckpt_steps=(2,))
  with pytest.raises(NonFiniteLossError, match=f"step {nan_steps[-1]}: .* in a row"):
    run()
  assert run.saved == [2]
  run = Run(losses=dict.fromkeys(nan_steps[1:], math.nan), total=20, policy="skip")
  run()  # One fewer in a row: the run goes on to the end.
  assert run.saved == ["end"] and run.records[-1]["step"] == 20


def test_hooks_run_in_order_at_their_period_and_the_last_step_and_one_may_stop():
  run = Run(total=7)
  calls = []
  run.loop.add_hook(lambda step, state: calls.append(("every 3", step)), every=3, name="third")
  run.loop.add_hook(lambda step, state: calls.append(("each", step)) or step == 4, name="stop")
  run.loop.add_hook(lambda step, state: calls.append(("never", step)), every=3)
  run()
  assert calls == [("each", 1), ("each", 2), ("every 3", 3), ("each", 3), ("never", 3), ("each", 4)]
  assert run.saved == [] and [r["step"] for r in run.records] == [1]  # Stopped: no end hook.
  assert [hook.name for hook in run.loop.hooks] == [
      "eval",
      "metrics",
      "checkpoint",
      "third",
      "stop",
      "<lambda>",
  ]
