"""strata-server's log, line for line as upstream llama-server's for the same events: start-up, a
completion, a malformed request, a prompt larger than the context, and shutdown on SIGINT and
SIGTERM; timestamps, timings, ports, clock readings and task ids aside."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

import servers

REPO = Path(__file__).resolve().parents[2]
STRATA = Path(os.environ.get("STRATA_SERVER", REPO / "target" / "release" / "strata-server"))
UPSTREAM = Path(os.environ.get("STRATA_UPSTREAM_SERVER", REPO / "target" / "upstream" / "bin" / "llama-server"))
MODEL = Path(os.environ.get("STRATA_MODELS", REPO / ".cache" / "models")) / "gemma3-270m-q4_k_m.gguf"

BLANKS = [
    (re.compile(r"^\d+\.\d{2}\.\d{3}\.\d{3} "), ""),
    # printf pads each figure to a width: the padding varies with the figure
    (re.compile(r" *\d+\.\d+ ms"), " X ms"),
    (re.compile(r" *[\d.]+ tokens per second"), " X tokens per second"),
    (re.compile(r"t_last = -?\d+"), "t_last = X"),
    (re.compile(r"127\.0\.0\.1:\d+"), "127.0.0.1:P"),
    (re.compile(r"task (id = )?\d+"), r"task \1N"),
    (re.compile(r"id_task = \d+"), "id_task = N"),
    (re.compile(r"from \S+/(libggml-\w+\.so)"), r"from DIR/\1"),
]


def normalized(log: str) -> list[str]:
    out = []
    for line in log.splitlines():
        for pattern, repl in BLANKS:
            line = pattern.sub(repl, line)
        # llama-server's HTTP thread cancels a failed request while its engine thread releases
        # the slot: the two lines come in either order there
        if out and "| stop processing:" in line and "stop: cancel task" in out[-1]:
            out.insert(len(out) - 1, line)
            continue
        out.append(line)
    return out


def post(url: str, body: bytes) -> tuple[int, dict]:
    req = urllib.request.Request(url + "/completion", data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def session(binary: Path, sig: int, extra: list[str]) -> tuple[list[str], int]:
    """The normalized log of a server that starts, answers three requests and gets `sig`."""
    if not binary.exists() or not MODEL.exists():
        pytest.skip(f"{binary} or the Gemma model is not built (run tools/setup and tools/build-upstream)")
    proc, url = servers.start(binary, ["-m", str(MODEL), "-c", "256", "-np", "1", *extra], stderr=subprocess.PIPE)
    answers = []
    for body in (json.dumps({"prompt": "Hello", "n_predict": 2, "temperature": 0}).encode(), b"{bad json",
                 json.dumps({"prompt": "word " * 400, "n_predict": 2}).encode()):
        answers.append(post(url, body))
        # llama-server answers before its slot's release line: let each request's lines land
        time.sleep(0.3)
    assert [a[0] for a in answers] == [200, 400, 400], answers
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    return normalized(err.decode()), proc.returncode


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["sigint", "sigterm"])
def test_the_log_is_upstreams_line_for_line(sig):
    # at llama-server's default verbosity; trace-level detail (-lv 4) is not all there
    upstream, up_rc = session(UPSTREAM, sig, [])
    strata, st_rc = session(STRATA, sig, [])
    assert st_rc == up_rc == 0
    assert strata == upstream
    assert any("E srv    send_error: task id = N, error: request (402 tokens) exceeds the available context size (256 tokens)" in line for line in strata)
    assert "W srv    operator(): got exception:" in "\n".join(strata)
    assert strata[-1] == "I srv    operator(): operator(): cleaning up before exit..."
