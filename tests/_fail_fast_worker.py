"""Worker for tests/test_distributed.py: one of two processes under jax.distributed; one of them raises.

Usage: python _fail_fast_worker.py PORT PROCESS_ID OUTDIR FAILING_PROCESS HOW WAIT
Both processes meet in a cross-process collective; then process FAILING_PROCESS raises a RuntimeError
while the other waits for it forever: WAIT "collective" enters the next collective (gloo may then
raise a connection error, which fail_fast turns into an exit), "sleep" blocks where no Python
exception can reach it, so that only jax can end it. HOW is "with" (`with ja.fail_fast():` around
the whole worker), "hook" (`ja.fail_fast().install()`, the exception left uncaught), or "plain" (no
fail_fast: for comparison by hand). shutdown_timeout_seconds keeps jax's default (300 s): without
fail_fast the failed process would wait that long at the shutdown barrier before its heartbeats stop.
"""

import sys
import time

HEARTBEAT_S = 5  # tests/test_distributed.py bounds the survivor's end with it
T0 = time.time()


def log(*what) -> None:
  print(f"[{time.time() - T0:6.1f} s]", *what, flush=True)


def work(port: str, process_id: str, failing: str, wait: str) -> None:
  from _multihost import init_distributed  # noqa: PLC0415  (tests/ is this script's directory)

  jax = init_distributed(port, process_id, 2, 1, initialization_timeout=60, heartbeat_timeout_seconds=HEARTBEAT_S)
  from jax.experimental import multihost_utils  # noqa: PLC0415

  multihost_utils.sync_global_devices("both up")  # a collective over both processes' devices
  log("both up")
  if jax.process_index() == int(failing):
    raise RuntimeError(f"process {failing} fails")
  if wait == "collective":
    multihost_utils.sync_global_devices("never completes")  # the other process never arrives
    log("unreachable: the collective completed")
  # "sleep": blocked where no Python exception can reach it (as in a collective that never errors):
  # only jax can end this process, when the failed process's heartbeats stop.
  while True:
    time.sleep(0.05)


def main(port: str, process_id: str, outdir: str, failing: str, how: str, wait: str) -> None:
  import jaxaccum as ja  # noqa: PLC0415

  if how == "with":
    with ja.fail_fast():
      work(port, process_id, failing, wait)
  elif how == "hook":
    ja.fail_fast().install()
    work(port, process_id, failing, wait)
  else:  # "plain": without fail_fast, for comparison (the failed process then waits at the shutdown barrier)
    work(port, process_id, failing, wait)


if __name__ == "__main__":
  main(*sys.argv[1:])
