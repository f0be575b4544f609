"""ja.fail_fast: one process of a jax.distributed job raises, and every process ends within the heartbeat timeout."""

import os
import signal
import subprocess
import sys
import time

import _fail_fast_worker as worker
import pytest
from _multihost import free_port, worker_env

import jaxaccum as ja

WORKER = os.path.join(os.path.dirname(__file__), "_fail_fast_worker.py")
TIMEOUT_S = 120


@pytest.mark.slow  # two 2-process jax.distributed jobs
def test_one_failing_process_ends_the_job_within_the_heartbeat_timeout(tmp_path):
  """Two 2-process jobs on 127.0.0.1 (gloo), run at once. In each, one process raises after a first collective
  while the other waits for it forever. Without fail_fast the failed process would wait at jax.distributed's
  shutdown barrier for shutdown_timeout_seconds (300 s by default, kept here) before its heartbeats stop.

  Job A: process 1 fails inside `with ja.fail_fast()`; process 0 (the coordination service) is blocked where no
  Python exception reaches it: jax terminates it once process 1's heartbeats stop.
  Job B: process 0 (the service) fails under `ja.fail_fast().install()`; process 1 waits in a collective.
  """
  env = worker_env()
  jobs = {"A": (1, "with", "sleep"), "B": (0, "hook", "collective")}
  procs, start = {}, time.monotonic()
  for name, (failing, how, wait) in jobs.items():
    port = free_port()
    for i in range(2):
      procs[name, i] = subprocess.Popen(
        [sys.executable, WORKER, str(port), str(i), str(tmp_path), str(failing), how, wait],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
      )
  ended = {}
  try:
    while len(ended) < len(procs) and time.monotonic() - start < TIMEOUT_S:
      for key, p in procs.items():
        if key not in ended and p.poll() is not None:
          ended[key] = time.monotonic() - start
      time.sleep(0.05)
  finally:
    for p in procs.values():  # no process is left running, whatever happened
      if p.poll() is None:
        p.kill()
      p.wait(timeout=10)
  logs = {key: p.stdout.read() for key, p in procs.items()}
  for name, (failing, _, _) in jobs.items():
    survivor = 1 - failing
    fail_log, survivor_log = logs[name, failing], logs[name, survivor]
    assert (name, failing) in ended and (name, survivor) in ended, (
      f"job {name}: a process hung\n{fail_log[-2000:]}\n{survivor_log[-2000:]}"
    )
    assert "both up" in fail_log, fail_log[-3000:]  # the failure came after the job was running
    assert procs[name, failing].returncode == 1, fail_log[-3000:]
    assert f"RuntimeError: process {failing} fails" in fail_log and "jaxaccum.fail_fast" in fail_log
    # The survivor is ended by jax (SIGABRT: the service saw the heartbeats stop, or lost the failed service),
    # or, where gloo raises a connection error into Python, by its own fail_fast (exit 1).
    assert procs[name, survivor].returncode in (-signal.SIGABRT, 1), survivor_log[-3000:]
    lag = ended[name, survivor] - ended[name, failing]
    assert lag < worker.HEARTBEAT_S + 10, (name, lag, survivor_log[-2000:])


def test_fail_fast_outside_a_distributed_job_changes_nothing():
  with pytest.raises(RuntimeError, match="boom"):  # one process: the exception propagates as usual
    with ja.fail_fast():
      raise RuntimeError("boom")
  with pytest.raises(SystemExit):
    with ja.fail_fast():
      sys.exit(0)

  @ja.fail_fast()
  def fails():
    raise ValueError("as a decorator")

  with pytest.raises(ValueError, match="as a decorator"):
    fails()
  previous = sys.excepthook
  guard = ja.fail_fast().install()
  try:
    assert sys.excepthook == guard._hook
  finally:
    guard.uninstall()
  assert sys.excepthook is previous
  for bad in (0, 256, True, 1.0, "1"):
    with pytest.raises(TypeError, match="exit_code="):
      ja.fail_fast(exit_code=bad)
