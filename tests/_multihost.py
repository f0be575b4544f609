"""Starting worker processes for the multi-process tests: a free loopback port, a clean env, bounded waits."""

import os
import socket
import subprocess
import sys


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def worker_env() -> dict:
  """This environment without XLA/JAX settings (each worker sets its own devices), the repo importable."""
  env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_FLAGS", "JAX_"))}
  env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.dirname(__file__)), env.get("PYTHONPATH", "")])
  return env


def run_workers(script: str, num_processes: int, out, timeout_s: float) -> list[str]:
  """Runs `script port index out` once per process; every wait bounded, leftovers killed. Returns the logs."""
  port = free_port()
  env = worker_env()
  procs = []
  try:
    for i in range(num_processes):
      procs.append(
        subprocess.Popen(
          [sys.executable, script, str(port), str(i), str(out)],
          env=env,
          stdout=subprocess.PIPE,
          stderr=subprocess.STDOUT,
          text=True,
        )
      )
    logs = [p.communicate(timeout=timeout_s)[0] for p in procs]
    for i, p in enumerate(procs):
      assert p.returncode == 0, f"process {i} failed:\n{logs[i][-3000:]}"
    return logs
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait(timeout=10)


def init_distributed(port: str, process_id: str, num_processes: int, local_devices: int, **timeouts):
  """In a worker: simulated CPU devices, gloo collectives, float64, then `jax.distributed.initialize` on loopback."""
  import jax  # noqa: PLC0415  (the worker configures jax before anything uses a device)

  jax.config.update("jax_num_cpu_devices", local_devices)
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.config.update("jax_enable_x64", True)
  timeouts.setdefault("initialization_timeout", 60)
  jax.distributed.initialize(
    coordinator_address=f"127.0.0.1:{port}", num_processes=num_processes, process_id=int(process_id), **timeouts
  )
  return jax
