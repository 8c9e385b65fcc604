"""Start and watch real llama.cpp servers for the backend tests.

- `LlamaServer.python(gguf)`: llama-cpp-python's OpenAI-compatible server
  (``python -m llama_cpp.server``), installed by ``.ci/llama-tools.sh``;
- `LlamaServer.cpp(gguf)`: llama.cpp's C++ ``llama-server`` (``/infill``, ``/slots``), built by the
  same script into ``~/.cache/spark-lsp/tools/llama-server-<version>/``.

`cpu_s()` reads the server process's CPU time from /proc: a server that still generates after a
cancel keeps burning CPU, one that stopped does not.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

VERSION = "0.3.36"
CPP_SERVER = (
    Path(os.environ.get("SPARK_TOOLS_DIR", Path.home() / ".cache/spark-lsp/tools"))
    / f"llama-server-{VERSION}"
    / "llama-server"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    def __init__(self, cmd: list[str], port: int, log: Path, ready_path: str) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log = log
        self._log_file = open(log, "wb")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(cmd, stdout=self._log_file, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 120
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"the llama server exited ({self.proc.returncode}):\n{self.log_text()[-3000:]}"
                )
            try:
                if httpx.get(self.url + ready_path, timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"the llama server did not start:\n{self.log_text()[-3000:]}")
            time.sleep(0.2)

    @classmethod
    def python(cls, gguf: Path, log: Path, n_ctx: int = 512) -> LlamaServer:
        port = free_port()
        return cls(
            [
                sys.executable,
                "-m",
                "llama_cpp.server",
                "--model",
                str(gguf),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--n_ctx",
                str(n_ctx),
                "--n_threads",
                "1",
                "--verbose",
                "false",
            ],
            port,
            log,
            "/v1/models",
        )

    @classmethod
    def cpp(cls, gguf: Path, log: Path, n_ctx: int = 512) -> LlamaServer:
        port = free_port()
        return cls(
            [
                str(CPP_SERVER),
                "-m",
                str(gguf),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "-c",
                str(n_ctx),
                "-t",
                "1",
                "-np",
                "1",
                "--slots",
                "--metrics",
            ],
            port,
            log,
            "/health",
        )

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def cpu_s(self) -> float:
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log_file.close()


def stop_latency_ms(
    server: LlamaServer, t_cancel: float, window_s: float = 1.0, grace_s: float = 0.1
) -> tuple[float, float]:
    """(ms from `t_cancel` to the server's last CPU tick, CPU seconds it used from `grace_s`
    after the cancel to the end of the window): sampled every 2 ms for `window_s`."""
    last_change, prev = t_cancel, server.cpu_s()
    at_grace = None
    end = t_cancel + window_s
    while (now := time.perf_counter()) < end:
        cur = server.cpu_s()
        if cur != prev:
            last_change, prev = now, cur
        if at_grace is None and now >= t_cancel + grace_s:
            at_grace = cur
        time.sleep(0.002)
    return (last_change - t_cancel) * 1e3, prev - (at_grace if at_grace is not None else prev)
