"""strata-server through the real OpenAI Python client: chat (streamed and not), JSON schema,
tools, legacy completions and the Responses API, on a real GGUF over loopback HTTP."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import servers

openai = pytest.importorskip("openai")

REPO = Path(__file__).resolve().parents[2]
SERVER = Path(os.environ.get("STRATA_SERVER", REPO / "target" / "release" / "strata-server"))
MODEL = REPO / ".cache" / "models" / "tiny-qwen3moe.gguf"

TOOLS = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}]


@pytest.fixture(scope="module")
def client():
    if not SERVER.exists() or not MODEL.exists():
        pytest.skip("strata-server or the tiny model is not built (run tools/setup)")
    proc, base = servers.start(SERVER, ["-m", str(MODEL), "-c", "2048", "-np", "2", "--jinja"])
    yield openai.OpenAI(base_url=base + "/v1", api_key="unused")
    proc.terminate()
    proc.wait(timeout=30)


def test_streamed_chat_equals_the_plain_answer(client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    plain = client.chat.completions.create(model="any", messages=messages, max_tokens=16, temperature=0)
    assert plain.object == "chat.completion"
    assert plain.choices[0].finish_reason in ("stop", "length")
    assert plain.usage.completion_tokens == 16 or plain.choices[0].finish_reason == "stop"

    chunks = list(client.chat.completions.create(
        model="any", messages=messages, max_tokens=16, temperature=0, stream=True,
        stream_options={"include_usage": True},
    ))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [plain.choices[0].finish_reason]


def test_json_schema_constrains_the_answer(client):
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "integer"}, "unit": {"type": "string", "enum": ["cm", "m"]}},
        "required": ["answer", "unit"],
        "additionalProperties": False,
    }
    res = client.chat.completions.create(
        model="any",
        messages=[{"role": "user", "content": "How tall is a door?"}],
        response_format={"type": "json_schema", "json_schema": {"name": "height", "schema": schema}},
        max_tokens=128,
        temperature=0,
    )
    assert res.choices[0].finish_reason == "stop"
    value = json.loads(res.choices[0].message.content)
    assert set(value) == {"answer", "unit"}
    assert isinstance(value["answer"], int) and value["unit"] in ("cm", "m")


def test_tools_and_a_tool_result_round_trip(client):
    first = client.chat.completions.create(
        model="any", messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=TOOLS, max_tokens=8, temperature=0,
    )
    assert first.choices[0].finish_reason in ("stop", "length", "tool_calls")
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})},
        }]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, cloudy"},
    ]
    chunks = list(client.chat.completions.create(
        model="any", messages=messages, tools=TOOLS, max_tokens=8, temperature=0, stream=True,
    ))
    assert chunks and all(c.object == "chat.completion.chunk" for c in chunks)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model="any", messages=[{"role": "user", "content": "hi"}],
            tools=[{"type": "function", "function": {"name": "x", "parameters": "not a schema"}}],
        )


def test_legacy_completions_and_responses(client):
    res = client.completions.create(model="any", prompt="Once upon a time", max_tokens=8, temperature=0)
    assert res.object == "text_completion" and res.usage.completion_tokens == 8
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="any", prompt="Once upon a time", max_tokens=8, temperature=0, stream=True))
    assert streamed == res.choices[0].text

    resp = client.responses.create(model="any", input="Once upon a time", max_output_tokens=8, temperature=0)
    assert resp.id.startswith("resp_") and resp.output[0].id.startswith("msg_")
    events = list(client.responses.create(
        model="any", input="Once upon a time", max_output_tokens=8, temperature=0, stream=True))
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    delta = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert delta == events[-1].response.output_text == resp.output_text
