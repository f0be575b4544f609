"""Worker for tests/test_checkpoint.py: one of several processes saving to the same checkpoint path at once.

Usage: python _checkpoint_concurrent_worker.py PATH SEED GO_FILE SAVES MODE
Writes GO_FILE.ready<SEED> once imported, waits (bounded) until GO_FILE exists, so that the processes
start saving together, then saves the
tree of `tree(SEED)` to PATH SAVES times. MODE "overwrite": overwrite=True; "overwrite-rename":
the same without renameat2 (the portable fallback of ja.checkpoint); "new": overwrite=False, where a
FileExistsError (another process won) is the expected outcome and is reported, not raised.
Prints "exists: ..." per refused save, then "saved N", and exits.
"""

import os
import sys
import time

import jax

jax.config.update("jax_enable_x64", True)

import numpy as np  # noqa: E402

import jaxaccum as ja  # noqa: E402


def tree(seed: int):
  rng = np.random.default_rng(seed)
  # A few leaves, one large enough for its own data file range: a save takes a while.
  return {"w": rng.normal(size=(64, 64)), "b": rng.normal(size=(64,)), "step": np.asarray(seed, np.int64)}


def main(path: str, seed: str, go: str, saves: str, mode: str) -> None:
  jax.devices()  # the backend up before the start line
  with open(f"{go}.ready{seed}", "w"):
    pass
  deadline = time.monotonic() + 60
  while not os.path.exists(go):
    if time.monotonic() > deadline:
      raise TimeoutError(f"{go} never appeared")
    time.sleep(0.005)
  if mode == "overwrite-rename":
    ja.checkpoint._renameat2 = None  # as on a system without renameat2
  saved = 0
  for _ in range(int(saves)):
    try:
      ja.checkpoint.save(path, tree(int(seed)), overwrite=mode.startswith("overwrite"))
      saved += 1
    except FileExistsError as e:
      assert mode == "new", e
      print("exists:", e, flush=True)
  print(f"saved {saved}", flush=True)


if __name__ == "__main__":
  main(*sys.argv[1:])
