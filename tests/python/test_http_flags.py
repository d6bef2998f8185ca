"""llama-server's HTTP options on strata-server and on upstream llama-server side by side:
--sse-ping-interval (and a request's sse_ping_interval) on a stream whose second prompt takes
longer to read than the interval, --timeout on a client that never finishes its request,
--reuse-port, and --threads-http (strata's runtime workers)."""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

import servers

REPO = Path(__file__).resolve().parents[2]
STRATA = Path(os.environ.get("STRATA_SERVER", REPO / "target" / "release" / "strata-server"))
UPSTREAM = Path(os.environ.get("STRATA_UPSTREAM_SERVER", REPO / "target" / "upstream" / "bin" / "llama-server"))
MODEL = Path(os.environ.get("STRATA_MODELS", REPO / ".cache" / "models")) / "gemma3-270m-q4_k_m.gguf"
BINARIES = {"strata": STRATA, "upstream": UPSTREAM}


def binary(name: str) -> Path:
    b = BINARIES[name]
    if not b.exists() or not MODEL.exists():
        pytest.skip(f"{b} or the Gemma model is not built (run tools/setup and tools/build-upstream)")
    return b


def stream_lines(port: int, body: dict) -> list[bytes]:
    """The lines of a streamed /completion, as they arrive."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    conn.request("POST", "/completion", json.dumps(body), {"Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200, r.read()
    lines = []
    while line := r.readline():
        lines.append(line)
    conn.close()
    return lines


@pytest.mark.parametrize("name", sorted(BINARIES))
def test_a_stream_silent_past_the_ping_interval_sends_sse_comments(name):
    # one slot: the second prompt is read after the first has answered, long enough
    # for several one-second intervals
    proc, url = servers.start(binary(name), ["-m", str(MODEL), "-c", "4096", "-np", "1", "--sse-ping-interval", "1"])
    port = int(url.rsplit(":", 1)[1])
    try:
        long = "The quick brown fox jumps over the lazy dog. " * 120
        body = {"prompt": ["Hi", long], "n_predict": 2, "stream": True, "temperature": 0}
        lines = stream_lines(port, body)
        # a later task's start is "data: null" on both servers
        data = [d for line in lines if line.startswith(b"data: ") and (d := json.loads(line[6:])) is not None]
        assert {d["index"] for d in data} == {0, 1} and sum(1 for d in data if d["stop"]) == 2
        pings = [i for i, line in enumerate(lines) if line == b":\n"]
        assert pings, f"{name}: no ping in {lines[:20]}"
        # each ping is an SSE comment of its own: ':' and an empty line, between events
        assert all(lines[i + 1] == b"\n" for i in pings)
        first_data = next(i for i, line in enumerate(lines) if line.startswith(b"data: "))
        last_data = max(i for i, line in enumerate(lines) if line.startswith(b"data: "))
        assert any(first_data < i < last_data for i in pings)
        # the request's own sse_ping_interval overrides the server's: -1 turns pings off
        quiet = stream_lines(port, {**body, "sse_ping_interval": -1})
        assert b":\n" not in quiet
        assert [d["content"] for x in quiet if x.startswith(b"data: ") and (d := json.loads(x[6:]))] == [d["content"] for d in data]
    finally:
        servers.stop(proc)


def router(name: str, *args: str, port: int) -> subprocess.Popen:
    """A server in router mode over an empty models directory: it binds without loading a model."""
    models = tempfile.mkdtemp(prefix="strata-empty-models-")
    return subprocess.Popen([str(binary(name)), "--models-dir", models, "--port", str(port), *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def healthy(port: int, proc: subprocess.Popen, timeout: float = 60) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
                s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                if s.recv(64).startswith(b"HTTP/1.1 200"):
                    return True
        except OSError:
            pass
        time.sleep(0.2)
    return False


@pytest.mark.parametrize("name", sorted(BINARIES))
def test_reuse_port_lets_a_second_server_bind_the_same_port(name):
    port = servers.free_port()
    first = router(name, "--reuse-port", port=port)
    try:
        assert healthy(port, first)
        second = router(name, "--reuse-port", port=port)
        try:
            assert healthy(port, second), f"{name}: a second server with --reuse-port did not start"
        finally:
            servers.stop(second)
        third = router(name, port=port)
        _, err = third.communicate(timeout=60)
        assert third.returncode == 1, err[-2000:]
        assert f"couldn't bind HTTP server socket, hostname: 127.0.0.1, port: {port}" in err
    finally:
        servers.stop(first)


@pytest.mark.parametrize("name", sorted(BINARIES))
def test_timeout_drops_a_client_that_never_finishes_its_request(name):
    port = servers.free_port()
    proc = router(name, "--timeout", "2", port=port)
    try:
        assert healthy(port, proc)
        with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
            t0 = time.time()
            try:
                got = s.recv(4096)
            except ConnectionResetError:
                got = b""
            waited = time.time() - t0
        # closed (possibly after a 408), not answered, and only after the timeout
        assert not got.startswith(b"HTTP/1.1 200"), got
        assert 1.5 < waited < 20, waited
    finally:
        servers.stop(proc)


def test_threads_http_sets_the_http_runtimes_workers():
    # llama-server's trace line, with the worker count strata-server's runtime reports
    for n in ("3", "5"):
        port = servers.free_port()
        proc = router("strata", "--threads-http", n, "-lv", "4", port=port)
        try:
            assert healthy(port, proc)
        finally:
            servers.stop(proc)
        err = proc.stderr.read()
        assert f"srv          init: using {n} threads for HTTP server" in err, err[-3000:]


def events(name: str, body: dict) -> list:
    proc, url = servers.start(binary(name), ["-m", str(MODEL), "-c", "1024", "-np", "1"])
    try:
        lines = stream_lines(int(url.rsplit(":", 1)[1]), body)
    finally:
        servers.stop(proc)
    keys = ("index", "content", "tokens", "stop", "id_slot", "tokens_predicted", "tokens_evaluated", "stop_type", "prompt")
    return [None if (d := json.loads(line[6:])) is None else {k: d.get(k) for k in keys}
            for line in lines if line.startswith(b"data: ")]


def test_a_multi_prompt_stream_is_upstreams_event_for_event():
    # partial results carry id_slot -1, a later prompt's start is "data: null", the final
    # results carry the prompt's text
    body = {"prompt": ["Hi", "The quick brown fox"], "n_predict": 2, "stream": True, "temperature": 0}
    strata, upstream = events("strata", body), events("upstream", body)
    assert strata == upstream
    assert None in strata and {e["id_slot"] for e in strata if e and not e["stop"]} == {-1}
    assert [e["prompt"] for e in strata if e and e["stop"]] == ["<bos>Hi", "<bos>The quick brown fox"]
