"""Pytest plugin: a real, throwaway redis-server for the tests (fixture `redis_url`)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

_START_TIMEOUT_S = 10.0


def free_port() -> int:
    """A loopback port with nothing listening on it (the OS picks one that is free now)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _answers_ping(port: int) -> bool:
    # Raw RESP, so waiting for the server does not depend on the client library under test.
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.fail("redis-server not found on PATH: install it (apt-get install redis-server)")
    workdir: Path = tmp_path_factory.mktemp("redis")
    port = free_port()
    # No persistence: the data dies with the process, and nothing is written outside workdir.
    cmd = [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    cmd += ["--dir", str(workdir)]
    log = (workdir / "redis.log").open("wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + _START_TIMEOUT_S
        while not _answers_ping(port):
            if proc.poll() is not None or time.monotonic() > deadline:
                output = (workdir / "redis.log").read_text(errors="replace")[-2000:]
                pytest.fail(f"redis-server did not start on port {port}:\n{output}")
            time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
