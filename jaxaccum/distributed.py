"""fail_fast(): when one process of a `jax.distributed` job fails, every process ends within the heartbeat timeout.

What happens without it (jax 0.10.2). A process that raises an uncaught
exception runs the interpreter's exit, and with it `jax.distributed.shutdown()`
(registered at exit), whose barrier waits up to `shutdown_timeout_seconds`
(default 300 s) for the other processes. They cannot come: they are blocked in
a collective (an all-reduce of the next step) that waits for the failed
process. So the job hangs for the whole shutdown timeout, and only then does
the failed process exit, its heartbeats stop, and the coordination service
terminate the others (SIGABRT, "... stopped sending heartbeats") up to
`heartbeat_timeout_seconds` later.

`fail_fast` skips the barrier on an uncaught exception: it prints the
traceback, flushes stdout, stderr and the logging handlers, and ends the
process with `os._exit`. The failed process is gone at once; the others are
terminated by JAX within `heartbeat_timeout_seconds` (a process blocked in a
collective cannot raise a Python exception, so ending it is JAX's job, and the
heartbeat timeout bounds it: set it with
`jax.distributed.initialize(..., heartbeat_timeout_seconds=...)`).

Two ways to use it, both documented in the checkpoint guide's "Many hosts"
section:

    with ja.fail_fast():          # or decorate main(): @ja.fail_fast()
      jax.distributed.initialize(...)
      train()

    ja.fail_fast().install()      # sys.excepthook: any uncaught exception in the main thread

Only exceptions end the process this way: a clean exit (or `sys.exit(0)`)
still runs `jax.distributed.shutdown()` and its barrier, as every process is
then on its way out too. Without `jax.distributed` (one process) `fail_fast`
does nothing: the exception propagates as usual. `os._exit` skips `atexit`
handlers and `finally` blocks further up, and does not flush files other than
stdout and stderr: checkpoints written by `ja.checkpoint.save` are on disk
when it returns, so the last one is complete.
"""

from __future__ import annotations

import contextlib
import logging
import numbers
import os
import sys
import traceback
from collections.abc import Callable
from types import TracebackType
from typing import Any, Literal

import jax

__all__ = ["fail_fast"]


def _in_distributed_job() -> bool:
  return jax.distributed.is_initialized()


def _exit_now(exc_type, exc, tb, exit_code: int) -> None:
  """Prints the exception, flushes what can be flushed, and ends the process without the shutdown barrier."""
  code = exit_code
  try:
    if isinstance(exc, SystemExit):  # sys.exit(n): keep its code and its message, as Python would
      if isinstance(exc.code, numbers.Integral) and not isinstance(exc.code, bool):
        code = int(exc.code)
      elif exc.code is not None:
        print(exc.code, file=sys.stderr)
    else:
      traceback.print_exception(exc_type, exc, tb)
    print(
      f"jaxaccum.fail_fast: process {jax.process_index()} of {jax.process_count()} exits now (code {code}) "
      "without jax.distributed's shutdown barrier; the other processes end within heartbeat_timeout_seconds",
      file=sys.stderr,
    )
  finally:
    for stream in (sys.stdout, sys.stderr):
      with contextlib.suppress(Exception):
        stream.flush()
    with contextlib.suppress(Exception):
      logging.shutdown()  # flushes (and closes) the logging handlers
    os._exit(code)


class fail_fast(contextlib.ContextDecorator):  # noqa: N801  (used like a function: `with ja.fail_fast():`)
  """Ends this process at once on an uncaught exception in a `jax.distributed` job (see the module docstring).

  Use as a context manager (`with ja.fail_fast(): main()`), a decorator
  (`@ja.fail_fast()`), or install it as `sys.excepthook`
  (`ja.fail_fast().install()`). On an exception, while `jax.distributed` is
  initialized, it prints the traceback, flushes stdout/stderr and logging, and
  calls `os._exit(exit_code)`: the shutdown barrier (up to
  `shutdown_timeout_seconds`, 300 s by default) is skipped, so the other
  processes are ended by JAX within `heartbeat_timeout_seconds`. `sys.exit(n)`
  with n != 0 exits with n the same way; `sys.exit(0)` and `sys.exit()` exit
  normally. Without `jax.distributed` it does nothing.

  Args:
    exit_code: the exit status after an exception (default 1).
  """

  def __init__(self, *, exit_code: int = 1):
    if isinstance(exit_code, bool) or not isinstance(exit_code, numbers.Integral) or not 0 < exit_code < 256:
      raise TypeError(f"{exit_code=} must be an int in [1, 255] (a failure's exit status)")
    self.exit_code: int = int(exit_code)
    self._previous_hook: Callable[..., Any] | None = None

  def __enter__(self) -> fail_fast:
    return self

  def __exit__(self, exc_type, exc, tb: TracebackType | None) -> Literal[False]:
    if exc_type is None or not _in_distributed_job():
      return False
    if isinstance(exc, SystemExit) and exc.code in (None, 0):
      return False  # a clean exit: the shutdown barrier is where every process meets
    _exit_now(exc_type, exc, tb, self.exit_code)
    return False  # not reached

  def install(self) -> fail_fast:
    """Installs this as `sys.excepthook` (uncaught exceptions of the main thread); returns self.

    Outside a `jax.distributed` job the hook hands the exception to the hook it
    replaced. `uninstall()` puts that one back.
    """
    if self._previous_hook is None:
      self._previous_hook = sys.excepthook
      sys.excepthook = self._hook
    return self

  def uninstall(self) -> None:
    """Restores the `sys.excepthook` that `install` replaced."""
    if self._previous_hook is not None:
      if sys.excepthook == self._hook:
        sys.excepthook = self._previous_hook
      self._previous_hook = None

  def _hook(self, exc_type, exc, tb) -> None:
    previous = self._previous_hook or sys.__excepthook__
    if not _in_distributed_job():
      previous(exc_type, exc, tb)
      return
    _exit_now(exc_type, exc, tb, self.exit_code)
