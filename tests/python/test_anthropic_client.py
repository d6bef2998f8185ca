"""strata-server through the real Anthropic Python client: messages (streamed and not), token
counting and the client's own error handling, on a real GGUF over loopback HTTP."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import servers

anthropic = pytest.importorskip("anthropic")

REPO = Path(__file__).resolve().parents[2]
SERVER = Path(os.environ.get("STRATA_SERVER", REPO / "target" / "release" / "strata-server"))
MODEL = REPO / ".cache" / "models" / "tiny-qwen3moe.gguf"


@pytest.fixture(scope="module")
def client():
    if not SERVER.exists() or not MODEL.exists():
        pytest.skip("strata-server or the tiny model is not built (run tools/setup)")
    proc, base = servers.start(SERVER, ["-m", str(MODEL), "-c", "2048", "-np", "2", "--jinja"])
    yield anthropic.Anthropic(base_url=base, api_key="unused")
    proc.terminate()
    proc.wait(timeout=30)


def test_streamed_message_equals_the_plain_answer(client):
    # this client version has no sampling parameters of its own: greedy goes in extra_body
    args = dict(model="any", max_tokens=16, extra_body={"temperature": 0}, system="Be brief.",
                messages=[{"role": "user", "content": "Name a colour."}])
    plain = client.messages.create(**args)
    assert plain.type == "message" and plain.role == "assistant"
    assert plain.stop_reason in ("end_turn", "max_tokens")
    text = "".join(b.text for b in plain.content if b.type == "text")
    with client.messages.stream(**args) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == text
    assert final.usage.output_tokens == plain.usage.output_tokens


def test_count_tokens(client):
    n = client.messages.count_tokens(model="any", messages=[{"role": "user", "content": "Hello there"}])
    assert n.input_tokens > 0


def test_a_refused_request_raises_the_clients_error(client):
    # llama-server's schema refuses the limit; the client raises its own exception type for it
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="any", max_tokens=-5, messages=[{"role": "user", "content": "ok"}])
    assert e.value.status_code == 400
    assert "Field 'max_tokens': Value must be between -1" in str(e.value)
    assert client.messages.create(model="any", max_tokens=2, messages=[{"role": "user", "content": "ok"}]).content is not None
