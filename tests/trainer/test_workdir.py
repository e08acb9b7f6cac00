"""trainers/rundir/workdir.py: an earlier run's files are moved aside, never truncated; lines are whole JSON."""

import json
import math
import os
import subprocess
import sys

import pytest
from etils import epath

from trainers.errors import ConfigError
from trainers.rundir import events, parts, workdir


def fill(path, content):
  path.mkdir(exist_ok=True)
  for name in workdir.RUN_FILES:
    (path / name).write_bytes(content + name.encode())


def test_fresh_workdir_is_created_with_no_note(tmp_path):
  assert workdir.prepare(str(tmp_path / "new"), resuming=False) is None
  assert (tmp_path / "new").is_dir() and not any((tmp_path / "new").iterdir())


def test_used_workdir_moves_each_earlier_run_to_its_own_attempt(tmp_path):
  for attempt in (1, 2):
    fill(tmp_path, f"run {attempt}: ".encode())
    note = workdir.prepare(str(tmp_path), resuming=False)
    assert note == (
        f"workdir {tmp_path} held an earlier run: moved config.json, metrics.jsonl, metrics, "
        "tensorboard into "
        f"{tmp_path}/attempt-{attempt} (nothing deleted); starting fresh"
    )
    for name in workdir.RUN_FILES:
      assert (
          tmp_path / f"attempt-{attempt}" / name
      ).read_bytes() == f"run {attempt}: {name}".encode()
      assert not (tmp_path / name).exists()
  assert sorted(p.name for p in tmp_path.iterdir()) == ["attempt-1", "attempt-2"]


def test_resuming_keeps_the_files(tmp_path):
  fill(tmp_path, b"kept: ")
  assert workdir.prepare(str(tmp_path), resuming=True) is None
  assert (tmp_path / "metrics.jsonl").read_bytes() == b"kept: metrics.jsonl"


def test_only_metrics_is_moved_when_alone(tmp_path):
  (tmp_path / "metrics.jsonl").write_text("x\n")
  note = workdir.prepare(str(tmp_path), resuming=False)
  assert "moved metrics.jsonl into" in note
  assert (tmp_path / "attempt-1" / "metrics.jsonl").read_text() == "x\n"


def test_config_is_replaced_whole(tmp_path):
  workdir.write_config(str(tmp_path), '{"lr": 1}')
  workdir.write_config(str(tmp_path), '{"lr": 2}')
  assert json.loads((tmp_path / "config.json").read_text()) == {"lr": 2}
  assert sorted(os.listdir(tmp_path)) == ["config.json"]


def test_metrics_lines_are_strict_json_without_nan(tmp_path):
  writer = workdir.MetricsWriter(str(tmp_path))
  values = [1.5, math.nan, math.inf, -math.inf, 7]
  for step, loss in enumerate(values):
    writer.write({"step": step, "loss": loss})
  text = (tmp_path / "metrics.jsonl").read_text()
  records = [json.loads(line) for line in text.splitlines()]
  assert [r["loss"] for r in records] == [1.5, None, None, None, 7]
  assert "NaN" not in text and "Infinity" not in text and text.endswith("\n")


def test_a_killed_writer_leaves_whole_lines_and_at_most_a_cut_off_last_one(tmp_path):
  """A process killed while writing long lines in a loop leaves every line whole but maybe
  the last (Linux ends a write at a page boundary when SIGKILL arrives), and the resuming
  run moves a cut-off last line out of the file."""
  code = (
      "import sys; from trainers.rundir import workdir\n"
      "w = workdir.MetricsWriter(sys.argv[1])\n"
      "for step in range(10**9):\n"
      "  w.write({'step': step, 'pad': 'x' * 4000})\n"
      "  if step == 200: print('ready', flush=True)\n"
  )
  proc = subprocess.Popen(
      [sys.executable, "-c", code, str(tmp_path)],
      cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
      stdout=subprocess.PIPE,
      text=True,
  )
  assert proc.stdout.readline().strip() == "ready"
  proc.kill()
  proc.wait()
  path = tmp_path / "metrics.jsonl"
  whole, _, cut = path.read_text().rpartition("\n")
  lines = whole.split("\n")
  assert len(lines) > 200
  assert [json.loads(line)["step"] for line in lines] == list(range(len(lines)))
  moved = workdir.keep_metrics_until(str(path), len(lines) - 1)
  assert path.read_text() == whole + "\n"
  assert (moved is None) == (cut == "")


def test_check_refuses_a_file_and_accepts_a_new_nested_directory(tmp_path):
  (tmp_path / "file").write_text("mine")
  with pytest.raises(ConfigError, match=r"--workdir=.*/file/run: .*/file is a file"):
    workdir.check(str(tmp_path / "file" / "run"))
  workdir.check(str(tmp_path / "a" / "b"))
  assert sorted(os.listdir(tmp_path)) == ["file"] and (tmp_path / "file").read_text() == "mine"


def test_resume_moves_the_event_files_with_the_metrics_and_replays_the_kept(tmp_path):
  """TensorBoard shows each step once: the dead attempt's curves go to attempt-1/."""
  metrics, curves = workdir.MetricsWriter(tmp_path), events.EventWriter(tmp_path)
  records = [{"step": s, "loss": 1.0 / s, "mfu": None, "flops_source": "jaxpr"} for s in (1, 2, 3)]
  for record in records:
    metrics.write(record)
    curves.write(record)
  curves.close()
  moved = workdir.keep_metrics_until(metrics.path, 2)
  assert moved == str(tmp_path / "attempt-1" / "metrics.jsonl")
  assert events.read_scalars(tmp_path / "attempt-1" / "tensorboard") == {
      "loss": [(1, 1.0), (2, 0.5), (3, pytest.approx(1 / 3))]
  }
  assert not (tmp_path / "tensorboard").exists()
  fresh = events.EventWriter(tmp_path)
  for record in workdir.read_records(metrics.path):
    fresh.write(record)
  fresh.write({"step": 3, "loss": 0.25})
  fresh.close()
  assert events.read_scalars(tmp_path / "tensorboard") == {"loss": [(1, 1.0), (2, 0.5), (3, 0.25)]}


def test_a_failed_background_write_is_raised_to_the_caller(tmp_path):
  log = parts.Parts(epath.Path(tmp_path / "missing"), "{:08d}.jsonl")
  log.put(b"one\n")  # Returns: the thread writes it.
  with pytest.raises(FileNotFoundError):
    log.until_written()()
  with pytest.raises(FileNotFoundError):
    log.put(b"two\n")


@pytest.mark.parametrize(
    ("given", "fragment"),
    [("", "--workdir is empty"), ("gs:/bucket/run", "missing a slash; write gs://bucket/run")],
)
def test_an_empty_or_mangled_workdir_is_refused_before_anything_exists(
    tmp_path, monkeypatch, given, fragment
):
  monkeypatch.chdir(tmp_path)
  with pytest.raises(ConfigError, match=fragment):
    workdir.check(given)
  assert os.listdir(tmp_path) == []
