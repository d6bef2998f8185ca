"""Starting a llama-server-compatible binary on a free loopback port for the Python tests."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from strata_tools import NotReady, free_port, stop, wait_healthy  # noqa: F401


def start(binary: Path, args: list[str], stderr=subprocess.DEVNULL) -> tuple[subprocess.Popen, str]:
    """The server process and its base URL, once /health says ok; fails the test otherwise."""
    port = free_port()
    proc = subprocess.Popen([str(binary), *args, "--port", str(port)], stdout=subprocess.DEVNULL, stderr=stderr)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, timeout=120, poll=0.2)
    except NotReady as e:
        proc.kill()
        pytest.fail(f"{binary} {e}")
    return proc, url

