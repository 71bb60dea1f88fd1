"""`vllm serve` as a child process on loopback, for the example and the serving tests."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from .engine import engine_env

STARTUP_TIMEOUT_S = 600


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _healthy(base_url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{base_url}/health", timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


@dataclass(frozen=True)
class RunningServer:
    url: str  # http://127.0.0.1:PORT
    pid: int  # the API server process: where SIGUSR1 asks for routing statistics


@contextlib.contextmanager
def vllm_server(
    model_dir: str | Path,
    extra_args: list[str] = (),
    tensor_parallel_size: int = 1,
    log_path: Path | None = None,
    extra_env: dict[str, str] | None = None,
    enforce_eager: bool = False,
    data_parallel_size: int = 1,
) -> Iterator[RunningServer]:
    """Start `vllm serve` as users do (vLLM's default compiled mode unless `enforce_eager`), wait for /health,
    yield its URL and PID; the server is stopped on exit. `data_parallel_size` engines of `tensor_parallel_size`
    ranks each get one OpenMP core per rank, as TP ranks do (engine_env).

    The log goes to a file so a failed start can be reported with its cause."""
    port = free_port()
    log_path = log_path or Path(tempfile.mkstemp(prefix="vllm-serve-", suffix=".log")[1])
    vllm_bin = Path(sys.executable).with_name("vllm")
    cmd = [
        str(vllm_bin), "serve", str(model_dir), "--host", "127.0.0.1", "--port", str(port),
        "--max-model-len", "1024", "--tensor-parallel-size", str(tensor_parallel_size),
        *(["--data-parallel-size", str(data_parallel_size)] if data_parallel_size > 1 else []),
        *(["--enforce-eager"] if enforce_eager else []), *extra_args,
    ]
    env = {**os.environ, **engine_env(tensor_parallel_size * data_parallel_size), **(extra_env or {})}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the API server runs its engine core in a child
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not _healthy(base_url):
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = log_path.read_text()[-5000:]
                raise RuntimeError(f"vllm serve did not become healthy (exit {proc.poll()}); log tail:\n{tail}")
            time.sleep(1)
        yield RunningServer(base_url, proc.pid)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
