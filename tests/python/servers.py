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


def guard_root(d: Path) -> Path:
    """A cgroup-v2 fixture under d with 64 GiB available (STRATA_MEMGUARD_ROOT): the memory guard
    then admits a RAM copy on any test machine."""
    root = d / "root"
    (root / "proc/self").mkdir(parents=True)
    (root / "sys/fs/cgroup").mkdir(parents=True)
    (root / "proc/self/cgroup").write_text("0::/\n")
    (root / "proc/self/mountinfo").write_text("30 25 0:26 / /sys/fs/cgroup rw,relatime shared:4 - cgroup2 cgroup2 rw\n")
    (root / "proc/meminfo").write_text("MemTotal: 67108864 kB\nMemAvailable: 67108864 kB\n")
    return root
