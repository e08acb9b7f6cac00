"""gs:// workdirs: checked without any network call, and a run's files and checkpoints in a bucket.

The bucket is gcp-storage-emulator's (a pure-Python GCS emulator from PyPI) on 127.0.0.1,
serving gcsfs (the run's files, through etils.epath) and TensorStore (orbax's arrays) alike;
every client is pointed at it or given a token, so nothing leaves this machine.
"""

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import types
from http import HTTPStatus

import jax
import jax.numpy as jnp
import ml_collections
import pytest
from etils import epath
from gcp_storage_emulator import server as emulator_server
from gcp_storage_emulator import storage
from gcp_storage_emulator.exceptions import NotFound
from gcp_storage_emulator.handlers import objects
from gcp_storage_emulator.server import DELETE, GET, POST

from tests.helpers import ROOT, environment, quick_lm, run_module
from trainers import loop, optimizers, start
from trainers.errors import ConfigError
from trainers.figures import utilization
from trainers.hooks import divergence
from trainers.hooks import metrics as metrics_hook
from trainers.launch import free_port
from trainers.rundir import (
    checkpoint,
    events,
    lock,
    parts,
    paths,
    profiling,
    provenance,
    workdir,
)

BUCKET = "bucket"
STORED = []  # Called with each object's name and bytes once the emulator stores it.


def with_generation(download):
  """gcp-storage-emulator's download handler, answering with the object's generation header
  too, as GCS does (TensorStore reads an OCDBT manifest's generation from it: without it, a
  second write of a checkpoint's manifest fails, "Malformed StorageGeneration")."""

  def handler(request, response, storage, *args, **kwargs):
    download(request, response, storage, *args, **kwargs)
    if response.status == HTTPStatus.OK or response.status == HTTPStatus.PARTIAL_CONTENT:
      bucket, name = request.params["bucket_name"], request.params["object_id"]
      response["x-goog-generation"] = storage.get_file_obj(bucket, name)["generation"]

  return handler


def with_precondition(handler, object_name):
  """gcp-storage-emulator's ``handler``, first checking the request's ``ifGenerationMatch`` as
  GCS does (the emulator ignores it): unless the object's generation is that one ("0": the
  object is absent), the answer is 412 Precondition Failed and nothing is written or deleted.
  The workdir lock's writes and deletes are conditional (trainers/rundir/lock.py). The emulator
  serves one request at a time, so the check and the write are one step, as in GCS."""

  def handler_checked(request, response, storage, *args, **kwargs):
    wanted = request.query.get("ifGenerationMatch")
    if wanted:
      try:
        now = storage.get_file_obj(request.params["bucket_name"], object_name(request))
      except NotFound:
        now = {"generation": "0"}
      if now["generation"] != wanted[0]:
        response.status = HTTPStatus.PRECONDITION_FAILED
        response.json({"error": {"code": 412, "message": "Precondition Failed"}})
        return
    handler(request, response, storage, *args, **kwargs)

  return handler_checked


def watched(create_file):
  """The emulator's ``Storage.create_file``, then each of :data:`STORED` called with the new
  object's name and bytes. The emulator serves one request at a time, so nothing else reaches
  the bucket until they return."""

  def create_watched(self, bucket, name, content, *args, **kwargs):
    create_file(self, bucket, name, content, *args, **kwargs)
    for watch in list(STORED):
      watch(name, content)

  return create_watched


def _uploaded(request) -> str:
  """An upload's object name: in the query, or in a multipart or resumable upload's metadata."""
  if "name" in request.query:
    return request.query["name"][0]
  return (request.data.get("meta") or request.data)["name"]


@pytest.fixture(scope="module")
def emulator():
  """The emulator's environment (also set in this process while the module runs)."""
  swaps = [  # (method, the handler's name in objects, what serves it here)
      (GET, "download", with_generation(objects.download)),
      (POST, "insert", with_precondition(objects.insert, _uploaded)),
      (DELETE, "delete", with_precondition(objects.delete, lambda r: r.params["object_id"])),
  ]
  undo = []
  for method, name, handler in swaps:
    original = getattr(objects, name)
    routes = [m for _, m in emulator_server.HANDLERS if m.get(method) is original]
    for methods in routes:
      methods[method] = handler
    setattr(objects, name, handler)  # The router's fallback for uploads reads objects.insert.
    undo.append((method, name, original, routes))
  create_file = storage.Storage.create_file
  storage.Storage.create_file = watched(create_file)
  port = free_port()
  server = emulator_server.create_server("127.0.0.1", port, in_memory=True, default_bucket=BUCKET)
  server.start()
  url = f"http://127.0.0.1:{port}"
  env = {
      "STORAGE_EMULATOR_HOST": url,  # gcsfs
      "TENSORSTORE_GCS_HTTP_URL": url,  # orbax's arrays
      "GOOGLE_AUTH_TOKEN_FOR_TESTING": "emulator",  # TensorStore's token: no metadata server
      "FSSPEC_GCS_TOKEN": "anon",  # gcsfs's: no metadata server
      "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",  # no bucket-type probe over gRPC
  }
  before = {name: os.environ.get(name) for name in env}
  os.environ.update(env)
  yield env
  storage.Storage.create_file = create_file
  for method, name, original, routes in undo:
    setattr(objects, name, original)
    for methods in routes:
      methods[method] = original
  for name, value in before.items():
    if value is None:
      os.environ.pop(name)
    else:
      os.environ[name] = value
  server.stop()


def test_a_gs_workdir_without_backend_or_credentials_stops_before_any_network_call(
    tmp_path, monkeypatch
):
  def no_network(*args, **kwargs):
    raise AssertionError(f"network call {args}")

  monkeypatch.setattr(socket.socket, "connect", no_network)
  monkeypatch.setattr(socket, "getaddrinfo", no_network)
  monkeypatch.chdir(tmp_path)
  for name in ("GOOGLE_APPLICATION_CREDENTIALS", "STORAGE_EMULATOR_HOST"):
    monkeypatch.delenv(name, raising=False)
  monkeypatch.setenv("CLOUDSDK_CONFIG", str(tmp_path / "no-gcloud"))
  monkeypatch.setattr(paths, "GCE_PRODUCT_NAME", str(tmp_path / "not-a-gce-vm"))
  with pytest.raises(ConfigError) as no_credentials:
    workdir.check("gs://bucket/run")
  monkeypatch.setitem(sys.modules, "gcsfs", None)  # As where the .[gcs] extra is not installed.
  with pytest.raises(ConfigError) as no_backend:
    workdir.check("gs://bucket/run")
  with pytest.raises(ConfigError) as unknown:
    workdir.check("memory://run")
  assert "no Google Cloud credentials configured" in str(no_credentials.value)
  assert 'pip install -e ".[gcs]"' in str(no_backend.value)
  assert "scheme memory:// is not supported" in str(unknown.value)
  for error in (no_credentials, no_backend, unknown):
    assert "\n" not in str(error.value)
  assert os.listdir(tmp_path) == []  # No gs: (or memory:) folder.


def test_an_emulator_without_its_tensorstore_settings_is_refused(monkeypatch):
  monkeypatch.setenv("STORAGE_EMULATOR_HOST", "http://127.0.0.1:1")
  monkeypatch.delenv("TENSORSTORE_GCS_HTTP_URL", raising=False)
  with pytest.raises(ConfigError, match="TENSORSTORE_GCS_HTTP_URL is not set"):
    workdir.check("gs://bucket/run")


def test_the_run_files_in_a_bucket(emulator):
  run = f"gs://{BUCKET}/files"
  workdir.check(run)
  assert workdir.prepare(run, resuming=False) is None
  workdir.write_config(run, '{"lr": 0.1}')
  metrics, curves = workdir.MetricsWriter(run), events.EventWriter(run)
  for step in (1, 2, 3):
    record = {"step": step, "loss": 4.0 - step}
    metrics.write(record)
    curves.write(record)
    metrics.until_written()()  # One part each.
  metrics.close()
  curves.close()
  assert [r["step"] for r in workdir.read_records(metrics.path)] == [1, 2, 3]
  assert not epath.Path(metrics.path).exists()  # Only parts: metrics/00000001.jsonl, ...
  assert events.read_scalars(f"{run}/tensorboard")["loss"] == [(1, 3.0), (2, 2.0), (3, 1.0)]
  # A resume at step 2: step 3's line and the curves move to attempt-1.
  moved = workdir.keep_metrics_until(metrics.path, 2)
  assert moved == f"{run}/attempt-1/metrics.jsonl"
  assert [r["step"] for r in workdir.read_records(metrics.path)] == [1, 2]
  assert [p.name for p in workdir.record_files(metrics.path)] == [
      "00000001.jsonl",
      "00000002.jsonl",
  ]
  assert [r["step"] for r in workdir.read_records(moved)] == [3]
  assert not epath.Path(run, "tensorboard").exists()
  assert events.read_scalars(f"{run}/attempt-1/tensorboard")["loss"][-1] == (3, 1.0)
  first = provenance.record_start(run, _Config(), start_step=0, source="scratch")
  again = provenance.record_start(run, _Config(), start_step=2, source="a checkpoint")
  assert (first, again) == (f"{run}/starts/0", f"{run}/starts/1")
  # A fresh run on it: the earlier run's files move to attempt-2.
  note = workdir.prepare(run, resuming=False)
  assert "into gs://bucket/files/attempt-2" in note
  assert sorted(p.name for p in epath.Path(run, "attempt-2").iterdir()) == [
      "config.json",
      "metrics",
  ]
  assert [r["step"] for r in workdir.read_records(f"{run}/attempt-2/metrics.jsonl")] == [1, 2]


def test_a_gs_workdir_lock_refuses_a_second_run_until_released(emulator):
  run = f"gs://{BUCKET}/locked"
  lock.check_free(run)
  assert lock._read(run) is None  # check_free writes nothing.
  first = lock.hold(run)
  written = lock._read(run)
  refusals = []
  for attempt in (lock.check_free, lock.hold):
    with pytest.raises(ConfigError) as refused:
      attempt(run)
    refusals.append(str(refused.value))
  assert lock._read(run).holder == written.holder  # The refused runs wrote nothing.
  for line in refusals:
    assert f"is in use by another run (process {os.getpid()} on {socket.gethostname()}" in line
    assert "its lease lapses in 60 s if it stopped" in line and "\n" not in line
  first.release()
  assert lock._read(run) is None
  second = lock.hold(run)
  assert second.earlier is None
  second.release()


def test_a_gs_workdir_lock_is_renewed_and_a_lost_one_is_left_to_its_taker(emulator):
  """A 1 s lease, renewed every 0.25 s, is live after 1.5 s; another run's write (as a taker's
  after this run stalled past its lease) makes the next renewal fail: the lock is lost, and the
  release leaves the taker's object."""
  run = f"gs://{BUCKET}/renewed"
  held = lock.hold(run, lease_s=1.0)
  first = lock._read(run).generation
  time.sleep(1.5)
  with pytest.raises(ConfigError):
    lock.check_free(run)
  assert lock._read(run).generation != first and held.lost is None
  taker = {"pid": 7, "host": "host-b", "since": "now", "token": "b", "lease_s": 60}
  while True:  # Between two renewals.
    try:
      lock._write(run, taker, lock._read(run).generation)
      break
    except FileExistsError:
      pass
  deadline = time.monotonic() + 5
  while held.lost is None and time.monotonic() < deadline:
    time.sleep(0.05)
  assert held.lost["pid"] == 7
  with pytest.raises(ConfigError, match="taken over by another run \\(process 7 on host-b"):
    held.check()  # The loop's check before each save: this run saves nothing more.
  held.release()
  assert lock._read(run).holder["token"] == "b"  # Not deleted: the taker's lock.
  lock._delete(run, lock._read(run).generation)


def test_a_lapsed_gs_lock_is_taken_over_and_of_two_racing_takers_one_wins(emulator, monkeypatch):
  """The lock of a run that stopped renewing (killed: test_kill_then_resume_in_a_bucket_is_exact
  kills a real one) refuses others until its 1 s lease lapses, then one taker wins it."""
  run = f"gs://{BUCKET}/lapsed"
  killed = {"pid": 4242, "host": "host-a", "since": "then", "token": "a", "lease_s": 1}
  lock._write(run, killed, "0")
  with pytest.raises(ConfigError, match="process 4242 on host-a, since then; its lease lapses"):
    lock.hold(run)
  deadline = time.monotonic() + 10
  while True:  # The lease lapses 1 s after the last write (the server's whole-second Date).
    try:
      lock.check_free(run)
      break
    except ConfigError:
      assert time.monotonic() < deadline
      time.sleep(0.1)
  # Two runs take it over at once: each has read the lapsed lock before either writes.
  both_read, write = threading.Barrier(2, timeout=20), lock._write
  monkeypatch.setattr(lock, "_write", lambda *args: (both_read.wait(), write(*args))[1])
  outcomes = []

  def take():
    try:
      outcomes.append(lock.hold(run))
    except ConfigError as error:
      outcomes.append(error)

  takers = [threading.Thread(target=take) for _ in range(2)]
  for taker in takers:
    taker.start()
  for taker in takers:
    taker.join()
  monkeypatch.setattr(lock, "_write", write)
  won = [o for o in outcomes if isinstance(o, lock.Lease)]
  refused = [str(o) for o in outcomes if isinstance(o, ConfigError)]
  assert len(won) == 1 and len(refused) == 1, outcomes
  assert won[0].earlier["pid"] == 4242  # The takeover names the run that stopped.
  assert won[0].took_over() == (
      f"--workdir={run}: took over the lock of a run that stopped renewing it (process 4242 on "
      "host-a, since then): its 1 s lease lapsed, so that run was killed, lost its machine or hung"
  )
  assert f"is in use by another run (process {os.getpid()} on " in refused[0]
  assert lock._read(run).holder["token"] == won[0].record["token"]
  won[0].release()


def test_a_second_trainer_on_a_held_gs_workdir_stops_in_one_line(emulator):
  run = f"gs://{BUCKET}/busy"
  held = lock.hold(run)  # This process: the run that is using the workdir.
  done = run_module(
      "trainers.train",
      f"--workdir={run}",
      "--config=configs/lm.py",
      *quick_lm(2, 1, 1000, 1),
      timeout=120,
      env=emulator,
  )
  out = done.stdout + done.stderr
  assert done.returncode == 1 and "Traceback" not in out, out[-3000:]
  line = next(x for x in out.splitlines() if x.startswith("ConfigError:"))
  assert f"--workdir={run} is in use by another run (process {os.getpid()} on " in line
  assert lock._read(run).holder["token"] == held.record["token"]  # It wrote nothing.
  held.release()


HELD = 60.0  # Seconds a held object write waits for its release before it counts as waited on.


def test_records_in_a_bucket_cost_the_same_bytes_each_and_never_wait(emulator, monkeypatch):
  """Each record is sent once, as a new object of its own size, from the writers' threads:
  ``write`` returns while the emulator holds each object write, and only the wait
  ``until_written`` gives (a checkpoint save's thread calls it) waits for them. A ``write``
  that waited would hold its object HELD s, and the object says so; no clock is read."""
  received = []  # (object name, bytes) of each object the emulator stores.
  blocked = []  # Objects whose write was not released in time: a write that waited.
  release = threading.Event()
  store = storage.Storage.create_file

  def held_store(self, bucket, name, content, *args, **kwargs):
    if not release.wait(HELD):
      blocked.append(name)
    received.append((name, len(content)))
    return store(self, bucket, name, content, *args, **kwargs)

  monkeypatch.setattr(storage.Storage, "create_file", held_store)
  run = f"gs://{BUCKET}/paced"
  release.set()  # A header the writers send as they open goes at once.
  metrics, curves = workdir.MetricsWriter(run), events.EventWriter(run)
  records = [{"step": 100 + step, "loss": 1.0 + step} for step in range(1, 6)]
  sent = []
  for record in records:
    release.clear()
    metrics.write(record)
    curves.write(record)
    waits = [metrics.until_written(), curves.until_written()]
    release.set()  # Only now may this record's objects be stored.
    for wait in waits:
      wait()
    sent.append(sum(size for _, size in received) - sum(sent))
  metrics.close()
  curves.close()
  assert blocked == [] and min(sent) > 0  # Each wait returned with its record stored.
  lines = [len(workdir.json_line(r)) for r in records]
  parts = [(name.rsplit("/", 2)[-2], size) for name, size in received]
  assert [size for where, size in parts if where == "metrics"] == lines  # Each line once.
  events_sent = [size for where, size in parts if where == "tensorboard"]
  # The file's header event goes with the first record or alone; then one object per record.
  assert len(events_sent) in (len(records), len(records) + 1)
  assert len(set(events_sent[-(len(records) - 1) :])) == 1
  assert len(set(sent[1:])) == 1 and sent[-1] < 200  # Bytes per record: the same at record 5.
  assert workdir.read_records(metrics.path) == records
  assert events.read_scalars(f"{run}/tensorboard")["loss"] == [
      (r["step"], r["loss"]) for r in records
  ]


AHEAD = 3  # Steps the loop below begins while a metrics object write is held.


def test_the_loop_never_waits_on_a_record_and_a_checkpoint_follows_its_records(
    emulator, tmp_path, monkeypatch
):
  """trainers/loop.py's loop with its records in a bucket, a record every 5 steps and a
  (local) checkpoint at steps 15 and 30, each metrics object write held until the loop has
  begun AHEAD more steps (or the last): no step waits for a record (the save's own thread
  waits before it saves, trainers.loop.Pending), no checkpoint is committed before the records
  up to its step are stored, and every record is there at exit. A loop that waited for a
  write (it did before each save until this rule) would hold its record's write HELD s, and
  the write says so; no clock measures the steps, so a loaded host cannot fail it."""
  checkpoints = tmp_path / checkpoint.CHECKPOINTS
  early = []  # (checkpoint, record's step): a checkpoint committed before its record.
  waited = []  # Records' last steps whose write the loop waited for.
  began, progress = [], threading.Condition()
  store = storage.Storage.create_file
  run, total = f"gs://{BUCKET}/looped", 30

  def held_store(self, bucket, name, content, *args, **kwargs):
    if "/metrics/" in name:
      text = content if isinstance(content, str) else content.decode()
      stored = [json.loads(line)["step"] for line in text.splitlines()]
      due = min(max(stored) + AHEAD, total)
      with progress:
        if not progress.wait_for(lambda: len(began) >= due, timeout=HELD):
          waited.append(max(stored))
      done = [int(p.name) for p in checkpoints.iterdir() if p.name.isdigit()]
      early.extend((c, step) for step in stored for c in done if c >= step)
    return store(self, bucket, name, content, *args, **kwargs)

  monkeypatch.setattr(storage.Storage, "create_file", held_store)
  config = ml_collections.ConfigDict(
      dict(
          log_every=5,
          eval_every=1000,
          total_steps=total,
          batch_size=2,
          ckpt_steps=15,
          keep_ckpt_steps=None,
      )
  )
  metrics, curves = workdir.MetricsWriter(run), events.EventWriter(run)
  task = types.SimpleNamespace(unit="tokens", per_example=8, bytes_per_token=None)
  cost = utilization.StepCost(1e9, "jaxpr", 8, None)
  log = metrics_hook.StepLog(
      config,
      task,
      {},
      start.Start(0, "scratch"),
      lambda params: 0.0,
      metrics_hook.fan_out(metrics, curves),
      cost,
  )
  watch = divergence.LossWatch("stop", lr=1e-3)
  written = lambda: parts.each([metrics.until_written(), curves.until_written()])
  ckpt = checkpoint.Checkpoints(str(tmp_path), config, optimizers.BuiltOptimizer("adamw", {}))

  @jax.jit
  def step(state, batch):
    loss = jnp.sum(state["params"]["w"]) + batch
    state = {"params": {"w": state["params"]["w"] * 0.9}, "opt": {"n": state["opt"]["n"] + 1}}
    return state, {"loss": loss, "l2_grads": loss, "l2_params": loss, "l2_updates": loss}

  def counted(state, batch):
    with progress:
      began.append(batch)
      progress.notify_all()
    return step(state, batch)

  state = {"params": {"w": jnp.ones(4)}, "opt": {"n": jnp.zeros((), jnp.int32)}}
  no_plan = types.SimpleNamespace(mismatches=lambda state: [])
  looped = loop.Loop(counted, watch, no_plan, config, written)
  looped.add_hook(name="metrics", every=config.log_every, read=log)
  looped.add_checkpointer(ckpt)
  looped.run(state, ((i, jnp.float32(i)) for i in range(1, total + 1)))
  metrics.close()
  curves.close()
  assert waited == []  # Step 15's save too.
  assert early == [] and [p.name for p in checkpoints.iterdir() if p.name.isdigit()] == ["30"]
  logged = [1, *range(5, total + 1, 5)]
  assert [r["step"] for r in workdir.read_records(metrics.path)] == logged
  assert [s for s, _ in events.read_scalars(f"{run}/tensorboard")["loss"]] == logged


def test_a_profile_in_a_bucket_workdir(emulator, tmp_path, monkeypatch):
  """jax's profiler writes only to local paths: the trace goes to a local temporary directory,
  then into the bucket, and nothing of it stays on local disk."""
  monkeypatch.chdir(tmp_path)
  monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
  run = f"gs://{BUCKET}/profiled"
  trace = profiling.StepTrace((1, 2), run)
  trace.before(1)
  trace.after(1, state=jnp.arange(8.0) * 2)
  traced = list(epath.Path(run, "profile").glob("plugins/profile/*/*.xplane.pb"))
  assert len(traced) == 1 and traced[0].stat().length > 0
  assert os.listdir(tmp_path) == []  # The temporary directory is gone, and no gs: folder.


class _Config:
  """What provenance.record_start reads of a config."""

  def to_json_best_effort(self, indent):
    return '{"lr": 0.1}'


def _steps(path: str) -> dict[int, float]:
  return {r["step"]: r["loss"] for r in workdir.read_records(path)}


def kill_after_checkpoint(process, run: str, step: int):
  """A :data:`STORED` watcher that SIGKILLs ``process`` once checkpoint ``step`` of the bucket's
  ``run`` is committed (orbax's commit file: a bucket has no rename) and a later step's metrics
  record is stored, so a run resumed from that checkpoint recomputes some logged steps. It kills
  from inside the emulator's request, so the run stores nothing after that record."""
  committed = []

  def watch(name: str, content: bytes):
    if name == f"{run}/checkpoints/{step}/commit_success.txt":
      committed.append(name)
    elif committed and process.poll() is None and name.startswith(f"{run}/metrics"):
      if any(json.loads(line)["step"] > step for line in content.decode().splitlines()):
        process.kill()
        process.wait()

  return watch


@pytest.mark.timeout(600)
def test_kill_then_resume_in_a_bucket_is_exact(emulator):
  run, total = f"gs://{BUCKET}/run", 60
  cmd = [sys.executable, "-m", "trainers.train", f"--workdir={run}", "--config=configs/lm.py"]
  cmd += [*quick_lm(total, 1, 1000, 1), "--config.ckpt_steps=20", "--workdir_lease=1"]
  env = environment(**emulator)
  log = open(os.environ.get("BV_BUCKET_LOG", os.devnull), "w")
  first = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
  STORED.append(kill_after_checkpoint(first, "run", 20))
  try:
    first.wait(timeout=400)
  finally:
    STORED.clear()
  assert first.returncode == -signal.SIGKILL, "the run ended first"
  killed = _steps(f"{run}/metrics.jsonl")
  assert 20 < max(killed) < 40, "killed outside the steps after checkpoint 20"
  while True:  # The killed run's lock stays until its 1 s lease lapses.
    try:
      lock.check_free(run)
      break
    except ConfigError:
      time.sleep(0.1)
  done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  assert f"from {run}/checkpoints/" in done.stderr
  took_over = f"took over the lock of a run that stopped renewing it (process {first.pid} on "
  assert took_over in done.stderr and "its 1 s lease lapsed, so that run was killed" in done.stderr
  resumed = _steps(f"{run}/metrics.jsonl")
  assert sorted(resumed) == list(range(1, total + 1))
  again = [step for step in killed if step in resumed]
  assert again and all(resumed[s] == killed[s] for s in again)  # Bit for bit.
  moved = _steps(f"{run}/attempt-1/metrics.jsonl")
  assert moved and all(resumed[s] == loss for s, loss in moved.items())
  sampled = run_module(
      "trainers.sample",
      f"--workdir={run}",
      "--prompt=ab",
      "--max_new_tokens=4",
      "--temperature=0",
      timeout=300,
      env=emulator,
  )
  assert sampled.returncode == 0, sampled.stderr[-3000:]
  assert f"sampling from {run}/checkpoints/{total} " in sampled.stderr
  assert sampled.stdout.startswith("ab")
  assert not pathlib.Path(ROOT, "gs:").exists()
