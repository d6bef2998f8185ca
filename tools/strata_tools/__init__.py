"""Strata's Python tools, one package: what they share (the repository's root, a free loopback
port, waiting for a server's /health, stopping it, JSON requests, strata-server's /metrics
samples, arms given as `NAME=BIN ARGS --- NAME=BIN ARGS`, an error answer's message, writing a
result whole or not at all) here, each command in its own module.

The commands under tools/ are small wrappers that put tools/ on sys.path and call a module's
main(); the tests import the modules (pyproject.toml puts tools/ on pytest's path).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


class NotReady(Exception):
    """The server exited or did not answer /health with "ok" in time."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 1800, poll: float = 0.3) -> None:
    """Returns once GET url/health answers {"status": "ok"}; raises NotReady if proc exits first
    or timeout seconds pass."""
    deadline = time.time() + timeout
    while True:
        if proc.poll() is not None:
            raise NotReady(f"exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if json.load(r).get("status") == "ok":
                    return
        except (OSError, ValueError):
            pass
        if time.time() > deadline:
            raise NotReady(f"not ready in {timeout:.0f} s")
        time.sleep(poll)


def stop(proc: subprocess.Popen, timeout: float = 60) -> None:
    """SIGTERM, then SIGKILL if it has not exited after timeout seconds."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def get_json(url: str, timeout: float = 60) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.load(r)


def post_json(url: str, body: dict, timeout: float = 3600) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.load(r)


def http_error_message(e: urllib.error.HTTPError) -> str:
    """The message of an error answer: llama-server's {"error": {"message"}}, else its first line."""
    body = e.read().decode(errors="replace")
    try:
        return str(json.loads(body)["error"]["message"]).splitlines()[0]
    except (ValueError, KeyError, TypeError, IndexError):
        return (body.strip().splitlines() or [e.reason or "no body"])[0][:300]


def write_atomic(path: Path, text: str) -> None:
    """path holds text or, if writing fails, what it held before: the text goes to a temporary
    file beside it, renamed over it once written."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def strata_metrics(url: str) -> dict[str, float]:
    """The strata:* samples of /metrics, keyed by name with labels."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("strata:"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def split_arms(argv: list[str], tool: str = "device") -> list[tuple[str, list[str]]]:
    """`NAME=BIN ARGS --- NAME=BIN ARGS` into (name, command) pairs, in order."""
    arms: list[tuple[str, list[str]]] = []
    cur: list[str] = []
    for a in argv + ["---"]:
        if a != "---":
            cur.append(a)
            continue
        if cur:
            name, _, first = cur[0].partition("=")
            if not name or not first:
                raise SystemExit(f"{tool}: an arm starts NAME=BIN, not {cur[0]!r}")
            arms.append((name, [first] + cur[1:]))
        cur = []
    return arms
