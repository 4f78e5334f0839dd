"""A real ``tokenmill serve`` process on 127.0.0.1, driven by the official openai client.

Servers are started once per session (per set of arguments) and killed at the
end: each start loads a model, so tests share them.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

API_KEY = "test-key"
MODEL = "tiny-llama"
_START_TIMEOUT_S = 180


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def tokenmill_command() -> list[str]:
    """The installed ``tokenmill`` script of this interpreter (what a user runs)."""
    script = Path(sys.executable).with_name("tokenmill")
    found = str(script) if script.is_file() else shutil.which("tokenmill")
    return [found] if found else [sys.executable, "-c", "from tokenmill_cli.main import main; main()"]


class Server:
    def __init__(self, args: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        command = [*tokenmill_command(), "serve", *args, "--host", "127.0.0.1", "--port", str(self.port)]
        self._log = open(log_path, "wb")  # closed in stop()
        self._interrupted = False
        self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT,
                                        env={**os.environ, "TOKENIZERS_PARALLELISM": "false", **(env or {})})
        self._wait_healthy()

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + _START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"tokenmill serve exited with {self.process.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"tokenmill serve did not become healthy in {_START_TIMEOUT_S} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-5000:]

    def stats(self, api_key: str | None = API_KEY) -> dict:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        return httpx.get(f"{self.url}/engine/stats", headers=headers, timeout=10).json()

    def wait_idle(self, timeout_s: float = 30) -> dict:
        """Stats once no request is left in the engine (or the last ones seen at the timeout)."""
        deadline = time.monotonic() + timeout_s
        while True:
            stats = self.stats()
            if (stats["unfinished"] == 0 and stats["running"] == 0) or time.monotonic() > deadline:
                return stats
            time.sleep(0.05)

    def interrupt(self) -> None:
        """Start uvicorn's graceful shutdown without waiting for it (``stop`` waits). Sent once: a
        second SIGINT makes uvicorn skip the graceful part."""
        if self.process.poll() is None and not self._interrupted:
            self.process.send_signal(signal.SIGINT)
            self._interrupted = True

    def stop(self) -> None:
        if self.process.poll() is None:
            self.interrupt()
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()


@pytest.fixture(scope="session")
def start_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    """``start_server(args)`` -> a running :class:`Server`; each distinct ``args`` starts once."""
    servers: dict[tuple[str, ...], Server] = {}

    def start(args: list[str], env: dict[str, str] | None = None) -> Server:
        key = (*args, *sorted((env or {}).items()))
        if key not in servers:
            servers[key] = Server(args, tmp_path_factory.mktemp("serve") / "server.log", env)
        return servers[key]

    yield start
    # all asked to stop at once, then waited for: one by one, the session's few dozen servers
    # took over a minute of graceful shutdowns (1-2 s each)
    for server in servers.values():
        server.interrupt()
    for server in servers.values():
        server.stop()


@pytest.fixture(scope="session")
def tiny_args(llama_path: Path):
    """``tiny_args(*extra)``: serve arguments for the tiny Llama (its full 256-token context)."""

    def args(*extra: str) -> list[str]:
        return [str(llama_path), "--served-model-name", MODEL, "--max-model-len", "256",
                "--kv-cache-memory", "16MiB", "--dtype", "float32", *extra]

    return args


@pytest.fixture(scope="session")
def server(start_server, tiny_args) -> Server:
    """The tiny Llama behind an API key (taken from TOKENMILL_API_KEY, as in production)."""
    return start_server(tiny_args(), env={"TOKENMILL_API_KEY": API_KEY})


@pytest.fixture(scope="session")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="session")
def http(server: Server) -> Iterator[httpx.Client]:
    """Raw HTTP with the key, for the non-OpenAI routes and malformed requests."""
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as c:
        yield c


@pytest.fixture(scope="session")
def smollm_client(start_server) -> openai.OpenAI:
    """The default model (SmolLM2-135M-Instruct) with the hermes tool-call parser and ``auto`` allowed;
    ``.model`` is its served name."""
    server = start_server(["--max-model-len", "1024", "--kv-cache-memory", "256MiB", "--tool-call-parser",
                           "hermes", "--enable-auto-tool-choice"])
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    client.model = client.models.list().data[0].id
    return client
