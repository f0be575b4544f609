"""Worker for tests/test_checkpoint.py: one of two processes saving to the same checkpoint paths at once.

Usage: python _checkpoint_concurrent_worker.py DIR SEED GO_FILE SAVES HOW
Writes GO_FILE.ready<SEED> once imported and waits (bounded) until GO_FILE exists, so that the
processes start together. Then saves `tree(SEED)` to DIR/new with overwrite=False (the processes race:
one wins, the others get FileExistsError, reported as "new: exists"), then SAVES times to DIR/over
with overwrite=True. HOW "atomic" publishes with renameat2 as ja.checkpoint does on Linux; "fallback"
without it (the portable path). Prints "new: saved|exists" and "over: saved N", and exits.
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


def main(directory: str, seed: str, go: str, saves: str, how: str) -> None:
  jax.devices()  # the backend up before the start line
  with open(f"{go}.ready{seed}", "w"):
    pass
  deadline = time.monotonic() + 60
  while not os.path.exists(go):
    if time.monotonic() > deadline:
      raise TimeoutError(f"{go} never appeared")
    time.sleep(0.005)
  if how == "fallback":
    ja.checkpoint._renameat2 = None  # as on a system without renameat2
  try:
    ja.checkpoint.save(os.path.join(directory, "new"), tree(int(seed)))
    print("new: saved", flush=True)
  except FileExistsError as e:
    print("new: exists", e, flush=True)
  for _ in range(int(saves)):
    ja.checkpoint.save(os.path.join(directory, "over"), tree(int(seed)), overwrite=True)
  print(f"over: saved {saves}", flush=True)


if __name__ == "__main__":
  main(*sys.argv[1:])
