"""Worker for tests/test_multihost.py's recovery test: one of two processes under jax.distributed.

Usage: python _multihost_recovery_worker.py PORT PROCESS_ID OUTDIR MODE, MODE one of
  "raise": train, checkpoint after every step, process 1 raises after the checkpoint of step FAIL_AFTER;
  "kill": the same, but process 1 is killed (SIGKILL: no Python, no atexit) instead of raising;
  "resume": restore the last complete checkpoint in OUTDIR and train to STEPS (process 0 writes final.npz).

The settings that bound a failure (see run_guarded and the README's "Many hosts" section):
heartbeat_timeout_seconds=HEARTBEAT_S: a process that stops answering (killed, or exited without
jax.distributed.shutdown) is declared dead after this long, and every survivor is then terminated
(SIGABRT) by JAX: a survivor blocked in a collective cannot raise a Python exception.
shutdown_timeout_seconds=SHUTDOWN_S: how long jax.distributed.shutdown() (also run at exit) waits for
the other processes at its barrier; run_guarded skips it after an exception, so the failing process
exits at once and the survivors end HEARTBEAT_S later.
"""

import os
import signal
import sys
import time
import traceback

import _multihost_worker as base
import numpy as np

T0 = time.time()
STEPS, FAIL_AFTER, EVERY_K = 5, 3, 2
HEARTBEAT_S, SHUTDOWN_S, INIT_S = 5, 5, 60


def run_guarded(main, *args) -> None:
  """Runs main; on an exception prints it and leaves with os._exit(1), skipping the shutdown barrier.

  Without this, the interpreter's exit runs jax.distributed.shutdown(), which waits up to
  shutdown_timeout_seconds for the other processes (stuck in a collective that waits for this one)
  before this process can even exit; only then do its heartbeats stop.
  """
  try:
    main(*args)
  except BaseException:  # noqa: BLE001
    traceback.print_exc()
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(1)


def checkpoints(outdir: str) -> list[int]:
  return sorted(int(n[len("step_") :]) for n in os.listdir(outdir) if n.startswith("step_") and n[5:].isdigit())


def log(*what) -> None:
  print(f"[{time.time() - T0:6.1f} s]", *what, flush=True)


def main(port: str, process_id: str, outdir: str, mode: str) -> None:
  from _multihost import init_distributed  # noqa: PLC0415  (tests/ is this script's directory)

  jax = init_distributed(
    port,
    process_id,
    base.NUM_PROCESSES,
    base.LOCAL_DEVICES,
    initialization_timeout=INIT_S,
    heartbeat_timeout_seconds=HEARTBEAT_S,
    shutdown_timeout_seconds=SHUTDOWN_S,
  )
  log("jax.distributed initialized")
  import optax  # noqa: PLC0415

  import jaxaccum as ja  # noqa: PLC0415

  params, (x, y) = base.problem()
  rows = base.ROWS // base.NUM_PROCESSES
  mine = slice(jax.process_index() * rows, (jax.process_index() + 1) * rows)
  mesh = ja.data_mesh()
  opt = ja.accumulate(optax.adam(1e-2), EVERY_K)
  step = ja.make_train_step(base.loss_fn, opt, num_microbatches=base.K, mesh=mesh)
  p, s = ja.replicate(params, mesh), ja.replicate(opt.init(params), mesh)
  batch = ja.shard_batch((x[mine], y[mine]), mesh)
  first = 0
  if mode == "resume":
    first = checkpoints(outdir)[-1]
    p, s = ja.checkpoint.restore(os.path.join(outdir, f"step_{first}"), (p, s))
    if jax.process_index() == 0:
      np.savez(
        os.path.join(outdir, "restored.npz"), *[np.asarray(a.addressable_data(0)) for a in jax.tree.leaves((p, s))]
      )
  for i in range(first, STEPS):
    p, s, _ = step(p, s, batch)
    log("step", i + 1)
    if mode != "resume":
      ja.checkpoint.save(os.path.join(outdir, f"step_{i + 1}"), (p, s))
      if i + 1 == FAIL_AFTER:
        if jax.process_index() == 0:
          np.savez(
            os.path.join(outdir, "saved.npz"), *[np.asarray(a.addressable_data(0)) for a in jax.tree.leaves((p, s))]
          )
        elif mode == "raise":
          raise RuntimeError(f"worker 1 fails after step {i + 1}")
        else:
          os.kill(os.getpid(), signal.SIGKILL)
  if jax.process_index() == 0:
    np.savez(os.path.join(outdir, "final.npz"), *[np.asarray(a.addressable_data(0)) for a in jax.tree.leaves(p)])
  jax.distributed.shutdown()


if __name__ == "__main__":
  run_guarded(main, *sys.argv[1:])
