"""Starting a llama-server-compatible binary on a free loopback port for the Python tests."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
from strata_tools import NotReady, free_port, stop, wait_healthy  # noqa: E402,F401


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


def load_tool(path: Path):
    """A tool script without a .py suffix (tools/device/decodediag, tools/tune-gemm ...) as a module."""
    name = path.name.replace("-", "_")
    loader = importlib.machinery.SourceFileLoader(name, str(path))
    spec = importlib.util.spec_from_loader(name, loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod
