"""Requests that once killed or wedged strata-server, one per class of the llama.cpp calls they
reach (sampler settings, grammar triggers, token ids, vocabulary ranges, n_probs, slot ids,
malformed and oversized bodies): each gets llama-server's answer in its error shape, and the
server goes on serving, on the real Gemma 3 270M over loopback HTTP."""

from __future__ import annotations

import json
import os
import socket
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

import servers

REPO = Path(__file__).resolve().parents[2]
SERVER = Path(os.environ.get("STRATA_SERVER", REPO / "target" / "release" / "strata-server"))
MODEL = Path(os.environ.get("STRATA_MODELS", REPO / ".cache" / "models")) / "gemma3-270m-q4_k_m.gguf"


@pytest.fixture(scope="module")
def base():
    if not SERVER.exists() or not MODEL.exists():
        pytest.skip("strata-server or the Gemma model is not built (run tools/setup)")
    slots = tempfile.mkdtemp(prefix="strata-slots-")
    proc, url = servers.start(SERVER, ["-m", str(MODEL), "-c", "1024", "-np", "4", "-n", "4", "--slot-save-path", slots])
    yield url
    proc.terminate()
    proc.wait(timeout=30)


def send(url: str, path: str, body: bytes | dict | None, method: str = "POST") -> tuple[int, dict | str]:
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


def assert_error(answer, status: int, kind: str, message: str | None = None):
    got, body = answer
    assert got == status, body
    assert isinstance(body, dict) and set(body["error"]) >= {"code", "message", "type"}, body
    assert body["error"]["code"] == status and body["error"]["type"] == kind, body
    if message is not None:
        assert body["error"]["message"] == message, body


def assert_serving(url: str):
    status, body = send(url, "/health", None, "GET")
    assert status == 200 and body == {"status": "ok"}
    status, body = send(url, "/completion", {"prompt": "Hello", "n_predict": 2})
    assert status == 200 and body["tokens_predicted"] >= 1, body


def test_sampler_settings_outside_their_range_are_clamped_or_refused(base):
    # upstream clamps mirostat to 0..2 (common_sampler_init asserts on any other value); a
    # 64-bit value wraps into the 32-bit field first, as the JSON library converts it
    for mirostat, used in ((7, 2), (-1, 0), (2**63 - 1, 0), (2**32 + 1, 1)):
        status, body = send(base, "/completion", {"prompt": "x", "n_predict": 1, "mirostat": mirostat})
        assert status == 200, body
        assert body["generation_settings"]["mirostat"] == used
    assert_error(send(base, "/completion", {"prompt": "x", "n_predict": -5}), 400, "invalid_request_error",
                 "Field 'n_predict': Value must be between -1 <= value <= 2147483647, but got -5")
    assert_error(send(base, "/completion", {"prompt": "x", "repeat_penalty": 0}), 400, "invalid_request_error",
                 "Failed to initialize samplers: penalty_repeat must be finite and greater than 0")
    assert_error(send(base, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 5}),
                 400, "invalid_request_error", "Field 'n': Value must be between 1 <= value <= 4, but got 5")
    assert_serving(base)


def test_grammar_triggers_of_an_unknown_type_are_refused(base):
    # both servers abort on these in llama.cpp's sampler; strata-server refuses them
    for ty in (99, -1):
        answer = send(base, "/completion", {"prompt": "x", "grammar_triggers": [{"type": ty, "value": "x"}]})
        assert_error(answer, 400, "invalid_request_error")
        assert answer[1]["error"]["message"].startswith(f"Field 'grammar_triggers': unknown grammar trigger type {ty}")
    assert_error(send(base, "/completion", {"prompt": "x", "grammar_triggers": [5]}), 400, "invalid_request_error",
                 "Field 'grammar_triggers': [json.exception.type_error.304] cannot use at() with number")
    assert_serving(base)


def test_token_ids_outside_the_vocabulary_get_llama_cpp_exception_message(base):
    # llama.cpp throws std::out_of_range; llama-server answers 500 with its message
    for tokens in ([1, -1, 2], [262144]):
        status, body = send(base, "/tokenize", {"content": tokens, "with_pieces": True})
        assert status == 500 and body["error"]["message"].startswith("vector::_M_range_check"), body
        status, body = send(base, "/detokenize", {"tokens": tokens})
        assert status == 500 and body["error"]["message"].startswith("vector::_M_range_check"), body
    assert_error(send(base, "/completion", {"prompt": [1, 262144]}), 400, "invalid_request_error", "Prompt contains invalid tokens")
    assert_error(send(base, "/detokenize", {"tokens": 5}), 400, "invalid_request_error",
                 "[json.exception.type_error.302] type must be array, but is number")
    assert_serving(base)


def test_a_huge_n_probs_is_bounded_by_the_vocabulary(base):
    status, body = send(base, "/completion", {"prompt": "x", "n_predict": 1, "n_probs": 2**31 - 1, "post_sampling_probs": True})
    assert status == 200, body
    assert len(body["completion_probabilities"][0]["top_probs"]) <= 262144
    assert_serving(base)


def test_slot_ids_wrap_as_llama_server_wraps_them(base):
    # get_slot_by_id: the id wraps around the slot count as an unsigned number
    status, body = send(base, "/slots/-1?action=erase", {})
    assert status == 200 and body["id_slot"] == -1, body
    status, body = send(base, "/slots/9?action=erase", {})
    assert status == 200, body
    assert_error(send(base, "/slots/x?action=erase", {}), 400, "invalid_request_error", "Invalid slot ID")
    assert_error(send(base, "/slots/0?action=save", {"filename": 5}), 400, "invalid_request_error",
                 "[json.exception.type_error.302] type must be string, but is number")
    status, body = send(base, "/completion", {"prompt": "x", "n_predict": 1, "id_slot": 1000})
    assert status == 200, body
    assert_serving(base)


def test_bodies_malformed_large_or_on_the_wrong_method(base):
    status, body = send(base, "/completion", b"{not json")
    assert status == 400 and body["error"]["message"].startswith("[json.exception.parse_error.101]"), body
    assert_error(send(base, "/completion", b"[1,2]"), 400, "invalid_request_error",
                 "[json.exception.type_error.304] cannot use at() with array")
    # a multi-megabyte legitimate body is served (axum's default limit is 2 MB)
    status, body = send(base, "/tokenize", {"content": "hello " * 450_000})
    assert status == 200 and len(body["tokens"]) >= 450_000
    status, body = send(base, "/completion", {"prompt": "hi", "n_predict": 1, "x": "a" * (101 * 1024 * 1024)})
    assert status == 413, body
    assert_error(send(base, "/completion", None, "GET"), 404, "not_found_error", "File Not Found")
    assert_serving(base)


def test_a_client_that_goes_away_mid_stream_frees_its_slot(base):
    body = json.dumps({"prompt": "Tell me a story", "n_predict": 64, "stream": True}).encode()
    head = f"POST /completion HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    host, port = base.rsplit("//", 1)[1].split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(head.encode() + body)
        assert s.recv(200)
    for _ in range(100):
        status, slots = send(base, "/slots", None, "GET")
        if not any(s["is_processing"] for s in slots):
            break
        time.sleep(0.1)
    else:
        pytest.fail("a slot stayed busy after its client went away")
    assert_serving(base)
