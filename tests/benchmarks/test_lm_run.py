"""A trainer run as the quality benchmark starts it: its clock from its logged steps, and a
failed run's error quoting its log."""

import sys

import pytest

from benchmarks import lm_run

# 0.3 s apart, read as they come: the gap from the first to the last is 0.6 s, checked to 0.4 so
# that a loaded host's late read of one line does not fail it.
STEPS = (
    "import time\nfor s in (1, 2, 3):\n  time.sleep(0.3)\n"
    "  print(f'I x metrics.py:1] step {s}/3 loss=1.0', flush=True)\n"
)


def test_the_clock_runs_from_launch_to_the_first_and_last_logged_step(tmp_path):
  clock = lm_run.launch([sys.executable, "-c", STEPS], tmp_path / "log")
  assert 0.3 <= clock["first"] < clock["last"] <= clock["wall"]
  assert clock["last"] - clock["first"] >= 0.4
  assert (tmp_path / "log").read_text().count(" loss=1.0") == 3


def test_a_failed_run_raises_with_its_exit_status_and_last_lines(tmp_path):
  code = "import sys\nprint('\\n'.join(map(str, range(30))))\nprint('bad flag')\nsys.exit(3)"
  with pytest.raises(RuntimeError, match=r"(?s)failed \(exit 3\).*\n12\n.*29\nbad flag") as err:
    lm_run.launch([sys.executable, "-c", code], tmp_path / "log")
  assert "\n10\n" not in str(err.value)  # Only the log's last lines.


def test_a_run_that_logs_no_step_is_a_failure(tmp_path):
  with pytest.raises(RuntimeError, match=r"failed \(exit 0\)"):
    lm_run.launch([sys.executable, "-c", "print('no steps')"], tmp_path / "log")
