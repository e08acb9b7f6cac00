"""Starts N ``trainers.train`` processes on this host as one jax.distributed job.

  python -m trainers.launch --processes 2 --devices_per_process 4 -- \
      --config configs/lm.py --workdir /tmp/lm2

Process 0 coordinates on 127.0.0.1 at a free port. Every line a process prints is
prefixed with ``[pN] ``. If one process fails the others are killed, and the exit
status is the first failure's (124 if ``--timeout`` seconds pass first). A bad input (counts
below 1, a non-positive timeout, an unknown flag) ends it before anything is spawned, as one
line, ``ConfigError: ...``, with exit status 1 (``--debug``: the traceback).
SIGTERM is passed on to every process (they save a checkpoint at the same step and exit 0).
The processes die with the launcher, however it ends (``kill -9`` included): none is left
training on its own.
"""

import argparse
import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings

from trainers.settings import cli, validation

TIMED_OUT = 124
_PR_SET_PDEATHSIG = 1  # prctl(2)


def free_port() -> int:
  """A TCP port on 127.0.0.1 that was free a moment ago.

  Example:
    >>> 0 < free_port() < 2**16
    True
  """
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def commands(processes: int, devices: int, train_args: list[str]) -> list[list[str]]:
  """One ``python -m trainers.train`` command line per process.

  Example:
    >>> commands(2, 4, ["--config", "configs/lm.py"])[1][3:]
    ['--coordinator_address=127.0.0.1:...', '--num_processes=2', '--process_id=1',
     '--devices_per_process=4', '--config', 'configs/lm.py']
  """
  address = f"127.0.0.1:{free_port()}"
  return [
      [
          sys.executable,
          "-m",
          "trainers.train",
          f"--coordinator_address={address}",
          f"--num_processes={processes}",
          f"--process_id={i}",
          f"--devices_per_process={devices}",
          *train_args,
      ]
      for i in range(processes)
  ]


def stream(prefix: str, pipe) -> None:
  """Copies ``pipe`` to stdout line by line with ``prefix``."""
  for line in pipe:
    sys.stdout.write(prefix + line)
    sys.stdout.flush()


def die_with(parent: int) -> None:
  """In a child before it runs its command: the kernel kills it (SIGKILL) when ``parent``
  exits in any way, ``kill -9`` included (Linux's ``PR_SET_PDEATHSIG``; elsewhere a no-op),
  so no trainer outlives its launcher. A parent already gone kills it at once."""
  if not sys.platform.startswith("linux"):
    return
  ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
  if os.getppid() != parent:
    os.kill(os.getpid(), signal.SIGKILL)


def run(cmds: list[list[str]], timeout: float) -> int:
  """Runs ``cmds`` together; 0 if all succeed, else the first failure's status.

  Example:
    >>> run([[sys.executable, "-c", "pass"]] * 2, timeout=60)
    0
    >>> run([[sys.executable, "-c", "raise SystemExit(3)"], [sys.executable, "-c", "pass"]], 60)
    3
  """
  launcher = os.getpid()
  with warnings.catch_warnings():
    # preexec_fn makes subprocess fork, and jax warns of it in a process whose backend is up (a
    # caller's, a test's); the child only sets its death signal (die_with) and execs.
    warnings.filterwarnings("ignore", r"os\.fork\(\) was called", RuntimeWarning)
    procs = [
        subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            preexec_fn=lambda: die_with(launcher),
        )
        for cmd in cmds
    ]
  # A preemption notice (SIGTERM) reaches every process, as it reaches every host of a pod.
  signal.signal(signal.SIGTERM, lambda *_: [p.send_signal(signal.SIGTERM) for p in procs])
  threads = [
      threading.Thread(target=stream, args=(f"[p{i}] ", p.stdout), daemon=True)
      for i, p in enumerate(procs)
  ]
  for t in threads:
    t.start()
  deadline, status = time.monotonic() + timeout, 0
  while status == 0 and any(p.poll() is None for p in procs):
    if time.monotonic() > deadline:
      status = TIMED_OUT
      print(f"launch: timed out after {timeout:g} s", flush=True)
    status = status or next((p.returncode for p in procs if p.poll()), 0)
    time.sleep(0.1)
  status = status or next((p.returncode for p in procs if p.returncode), 0)
  for p in procs:
    if p.poll() is None:
      p.kill()
    p.wait()
  for t in threads:
    t.join()
  return status


def check_args(processes: int, devices: int, timeout: float) -> None:
  """Raises ``ConfigError`` for a count below 1 or a timeout that is not a positive number.

  Example: ``check_args(0, 4, 60)`` raises naming --processes.
  """
  validation.check_count("--processes", processes, example=2)
  validation.check_count("--devices_per_process", devices, example=4)
  validation.check_number("--timeout", timeout, positive=True, example=1800)


@cli.command
def main(argv=None) -> int:
  """``python -m trainers.launch ... -- TRAIN_ARGS``: the exit status (the first failure's)."""
  parser = cli.Parser("python -m trainers.launch", __doc__)
  parser.add_argument("--processes", type=int, default=2)
  parser.add_argument("--devices_per_process", type=int, default=4)
  parser.add_argument("--timeout", type=float, default=1800, help="seconds for the whole job")
  parser.add_argument(
      "train_args", nargs=argparse.REMAINDER, help="after --: arguments for trainers.train"
  )
  args = parser.parse_args(argv)
  train_args = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
  check_args(args.processes, args.devices_per_process, args.timeout)
  cmds = commands(args.processes, args.devices_per_process, train_args)
  return run(cmds, args.timeout)


if __name__ == "__main__":
  sys.exit(main())
