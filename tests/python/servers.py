"""Starting a llama-server-compatible binary on a free loopback port for the Python tests."""

from __future__ import annotations

import json
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(binary: Path, args: list[str], stderr=subprocess.DEVNULL) -> tuple[subprocess.Popen, str]:
    """The server process and its base URL, once /health says ok; fails the test otherwise."""
    port = free_port()
    proc = subprocess.Popen([str(binary), *args, "--port", str(port)], stdout=subprocess.DEVNULL, stderr=stderr)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while True:
        try:
            with urllib.request.urlopen(url + "/health") as r:
                if json.load(r).get("status") == "ok":
                    return proc, url
        except OSError:
            pass
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            pytest.fail(f"{binary} did not become ready")
        time.sleep(0.2)
