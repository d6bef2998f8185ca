"""Hostile and boundary requests for every route of llama-server, generated from a seed.

A case is a route, a valid base body for it, and mutations: one or a few fields set to values
from a palette (wrong types, range edges, encodings, sizes, nesting), the body itself broken
(bad JSON, wrong top-level type, truncation, deep nesting, huge), the method or path wrong, or the
socket used badly (slow writes, idle or abandoned connections, pipelining, bad framing).
The same seed gives the same cases, in the same order."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass, field

I32_MAX = 2**31 - 1

INTS = [0, 1, -1, 2, -2, 3, 4, 5, 7, 16, 100, -100, I32_MAX, I32_MAX + 1, -(2**31), -(2**31) - 1, 2**32 + 5,
        2**53, 2**63 - 1, 2**63, -(2**63), 2**64, 10**30, 0.5, 1.9, -0.9, 1e10, -1e10, 1e300]
FLOATS = [0, 0.0, 1, 1.0, -1, -1.0, 0.5, 1.5, 2, 0.99, 1.01, 100, -100, 1e-45, 1e-300, 3.5e38, 1e39, -1e39,
          1e300, 2**31, 2**63, 2**64]
BOOLS = [True, False, 0, 1, 2, -1, 0.0, "true", "false", "1"]
STRINGS = ["", "x", "auto", "none", " ", "\u0000", "\u00e9", "\U0001F600", "\ud7ff", "a" * 5000, "<start_of_turn>",
           "<bos>", "<eos>", "\n", "%s%n%x", "{{ x }}", "../../etc/passwd"]
WRONG = [None, True, False, 0, 1, -1, 1.5, "", "x", "5", [], [1], ["x"], [[]], [None], {}, {"a": 1}, {"type": 7}]

TOKENS_BAD = [[-1], [262144], [262145], [2**31 - 1], [2**31], [-(2**31)], [1, -5, 2], [1.5], [True], [None], ["x", -1],
              [2, 3, 99999999], [0], [[1, 2]], [[-1]], [{"x": 1}]]

SCHEMAS = [{"$ref": "#/definitions/nope"}, {"$ref": "#"}, "string", 5, None, [], {"type": "number"}, {"type": "foo"},
           {"type": ["string", "null"]}, {"type": "string", "pattern": "["}, {"type": "string", "pattern": "^a+$"},
           {"enum": []}, {"oneOf": []}, {"anyOf": [{"type": "integer"}, {"type": "string"}]},
           {"type": "integer", "minimum": 5, "maximum": 1}, {"type": "array", "minItems": 3, "maxItems": 1},
           {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "b"]},
           {"type": "object", "additionalProperties": 7}, {"type": "string", "format": "date-time"},
           {"type": "string", "minLength": 100000}, {"const": {"a": [1, {"b": None}]}}, {"allOf": "x"},
           {"type": "string", "minLength": 5, "maxLength": 2}, {"type": "array", "items": {"type": "integer"}, "minItems": 4, "maxItems": 2},
           {"type": "object", "properties": []}, {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}, {}]

GRAMMARS = ["root ::= \"a\"", "root ::= ", "root ::= undefined_rule", "((((", "root ::= [a-", "root ::= \"a\" root",
            "x ::= \"a\"", "root ::= \"\\xZZ\"", "root ::= [^]", "root ::= \"a\"{5,2}", "root ::= \"a\"{99999999}", ""]

TRIGGERS = [[{"type": 99, "value": "x"}], [{"type": -1, "value": "x"}], [{"type": 0, "value": "<start_of_turn>"}],
            [{"type": 0, "value": "x", "token": -5}], [{"type": 0, "value": "x", "token": 99999999}],
            [{"type": 0, "value": "x", "token": 2}], [{"type": 0, "value": "x", "token": "2"}],
            [{"type": 0, "value": "hello world"}], [{"type": 1, "value": "x"}], [{"type": 1, "token": 2}],
            [{"type": 1, "token": -5}], [{"type": 1, "token": 99999999}], [{"type": 2, "value": "("}],
            [{"type": 2, "value": "a+"}], [{"type": 3, "value": "[a-"}], [{"type": 3, "value": ".*"}],
            [{"type": "word", "value": "x"}], [{"type": 0}], [{"value": "x"}], ["x"], [{}], [1], "x", {}, []]

LOGIT_BIAS = [[[-1, 1]], [[2**31, 1]], [[262144, 1]], [[1, "x"]], [[1, None]], [[1, False]], [[1, True]],
              {"-1": 1}, {"999999999": -100}, {"hello": False}, {"1": "x"}, {"": 1}, [[1]], [[1, 2, 3]],
              [["hello", False]], [["", 5]], [[1.5, 1]], "x", 5, [], {}, [[1, 1e39]]]

LORA = [[{"id": 0, "scale": 1}], [{"id": -1, "scale": 1}], [{"id": 999, "scale": 1}], [{"scale": 1}], [{"id": 0}],
        [{"id": "0", "scale": "x"}], [{"id": 2**40, "scale": 1}], {}, "x", [1], [None], []]

MESSAGES = [
    [], [{}], [{"role": "user"}], [{"role": "user", "content": None}], [{"role": "user", "content": 5}],
    [{"role": "user", "content": {}}], [{"role": 5, "content": "hi"}], [{"role": "bogus", "content": "hi"}],
    [{"role": "assistant"}], [{"role": "assistant", "content": "partial"}],
    [{"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}],
    [{"role": "user", "content": []}], [{"role": "user", "content": [{}]}],
    [{"role": "user", "content": [{"type": "text"}]}], [{"role": "user", "content": [{"type": "text", "text": 5}]}],
    [{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]}],
    [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]}],
    [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/x.png"}}]}],
    [{"role": "user", "content": [{"type": "image_url"}]}],
    [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]}],
    [{"role": "user", "content": [{"type": "bogus"}]}], [{"role": "user", "content": ["hi"]}],
    [{"role": "tool", "content": "42"}], [{"role": "tool", "content": "42", "tool_call_id": 5}],
    [{"role": "assistant", "tool_calls": []}], [{"role": "assistant", "tool_calls": "x"}],
    [{"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{"}}]}],
    [{"role": "assistant", "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": {}}}]}],
    [{"role": "assistant", "tool_calls": [{}]}], [{"role": "system", "content": "be brief"}],
    [{"role": "user", "content": "hi", "name": 5}], [{"role": "user", "content": "hi", "reasoning_content": 7}],
    [{"role": "user", "content": "x" * 20000}], [{"role": "user", "content": "\u0000\udfff"}],
    [{"role": "user", "content": "hi"}] * 300, "hi", {"role": "user", "content": "hi"}, None, 5, [None], [5], [[]],
]

TOOLS = [[], "x", 5, {}, [{}], [{"type": "function"}], [{"type": "function", "function": {}}],
         [{"type": "function", "function": {"name": "f"}}],
         [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "string"}}}}}],
         [{"type": "function", "function": {"name": "f", "parameters": "x"}}],
         [{"type": "function", "function": {"name": 5, "parameters": {}}}], [{"type": "code_interpreter"}], [None]]

TOOL_CHOICE = ["auto", "none", "required", "bogus", "", 5, None, {}, {"type": "function", "function": {"name": "f"}},
               {"type": "function"}, []]

RESPONSE_FORMAT = [{"type": "text"}, {"type": "json_object"}, {"type": "json_schema"}, {"type": "bogus"},
                   {"type": "json_object", "schema": {"type": "number"}}, {"type": "json_schema", "json_schema": 5},
                   {"type": "json_schema", "json_schema": {"schema": {"type": "foo"}}},
                   {"type": "json_schema", "json_schema": {"schema": {"$ref": "#/x"}}}, {}, "json", 5, None, {"type": 5}]

PROMPTS = ["", " ", "hi", "\u0000", "x" * 3000, "hello " * 400, ["hi", "there"], [1, 2, 3], [], [[]], [[1, 2], [3]],
           ["hi", 5, "x"], [5, "hi"], {"prompt_string": "hi"}, {"prompt_string": "hi", "multimodal_data": ["aGVsbG8="]},
           {"prompt_string": 5}, {}, [{}], 5, 1.5, True, None, ["x"] * 10, [""], [[], []], [2] * 5000,
           "<start_of_turn>user\nhi<end_of_turn>\n"] + TOKENS_BAD


@dataclass
class Field:
    name: str
    values: list


def _f(name: str, *groups) -> Field:
    vals = []
    for g in groups:
        vals.extend(g if isinstance(g, list) else [g])
    return Field(name, vals)


NUM = INTS + WRONG
FLT = FLOATS + WRONG
BOOL = BOOLS + WRONG
STR = STRINGS + WRONG

# the fields of llama-server's completion schema, with the values worth trying on each
COMPLETION_FIELDS = [
    _f("verbose", BOOL), _f("timings_per_token", BOOL), _f("stream", BOOL),
    _f("stream_options", [{"include_usage": True}, {"include_usage": 5}, {"include_usage": "x"}, "x", 5, [], None]),
    _f("cache_prompt", BOOL), _f("return_tokens", BOOL), _f("return_progress", BOOL), _f("sse_ping_interval", NUM),
    _f("n_predict", NUM), _f("max_tokens", NUM), _f("max_completion_tokens", NUM), _f("n_indent", NUM),
    _f("n_keep", NUM), _f("n_discard", NUM), _f("n_cmpl", NUM), _f("n", NUM), _f("n_cache_reuse", NUM),
    _f("t_max_predict_ms", NUM), _f("response_fields", [["content"], ["generation_settings/n_predict"], [5], "x", {}, [], None]),
    _f("top_k", NUM), _f("top_p", FLT), _f("min_p", FLT), _f("top_n_sigma", FLT), _f("xtc_probability", FLT),
    _f("xtc_threshold", FLT), _f("typical_p", FLT), _f("temperature", FLT), _f("dynatemp_range", FLT),
    _f("dynatemp_exponent", FLT), _f("repeat_last_n", NUM), _f("repeat_penalty", FLT), _f("frequency_penalty", FLT),
    _f("presence_penalty", FLT), _f("dry_multiplier", FLT), _f("dry_base", FLT), _f("dry_allowed_length", NUM),
    _f("dry_penalty_last_n", NUM), _f("mirostat", NUM), _f("mirostat_tau", FLT), _f("mirostat_eta", FLT),
    _f("adaptive_target", FLT), _f("adaptive_decay", FLT), _f("seed", NUM), _f("n_probs", NUM), _f("logprobs", NUM),
    _f("min_keep", NUM), _f("backend_sampling", BOOL), _f("post_sampling_probs", BOOL), _f("lora", LORA),
    _f("dry_sequence_breakers", [[], ["\n"], [""], [5], "x", ["a"] * 100, None, {}]),
    _f("json_schema", SCHEMAS), _f("grammar", GRAMMARS, WRONG), _f("grammar_lazy", BOOL),
    _f("chat_format", [0, 1, 5, 999, -1, "x", None, 1.5]),
    _f("reasoning_format", ["none", "auto", "deepseek", "deepseek-legacy", "bogus", "", 5, None]),
    _f("generation_prompt", STR), _f("parse_tool_calls", BOOL), _f("chat_parser", ["", "x", "{", 5, None, "{}"]),
    _f("continue_final_message", [True, False, "auto", "bogus", 5, None, {}]), _f("echo", BOOL),
    _f("preserved_tokens", [["<start_of_turn>"], ["x"], [1], [""], "x", 5, {}, [None]]),
    _f("grammar_triggers", TRIGGERS), _f("reasoning_control", BOOL), _f("reasoning_budget_tokens", NUM),
    _f("reasoning_budget_start_tag", STR), _f("reasoning_budget_end_tags", [["</think>"], [""], [5], "x", 5, [], None]),
    _f("reasoning_budget_end_tag", STR), _f("reasoning_budget_message", STR), _f("logit_bias", LOGIT_BIAS),
    _f("ignore_eos", BOOL), _f("stop", [["\n"], [""], [5], "x", "", 5, {}, [None], ["a"] * 50, None]),
    _f("samplers", [["top_k", "top_p"], ["bogus"], "kpt", "zzz", "", [], [5], 5, None, {}]),
    _f("id_slot", NUM), _f("id", [5, "x", None]), _f("lora_adapters", LORA),
    _f("return_full_text", BOOL), _f("suffix", STR), _f("best_of", NUM), _f("user", STR),
]

PROMPT_FIELD = _f("prompt", PROMPTS)


@dataclass
class Route:
    path: str
    base: dict | list | None
    fields: list[Field]
    method: str = "POST"
    query: list[str] = field(default_factory=list)


CHAT_BASE = {"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 4}
CHAT_FIELDS = [
    _f("messages", MESSAGES), _f("tools", TOOLS), _f("tool_choice", TOOL_CHOICE), _f("response_format", RESPONSE_FORMAT),
    _f("parallel_tool_calls", BOOL), _f("add_generation_prompt", BOOL),
    _f("chat_template_kwargs", [{"enable_thinking": True}, {"enable_thinking": "x"}, {"enable_thinking": "\"x\""},
                                {"a": [1]}, "x", 5, [], None]),
    _f("reasoning_effort", ["none", "low", "high", "", 5, None, []]), _f("thinking_budget_tokens", NUM),
    _f("top_logprobs", NUM), _f("logprobs", BOOL), _f("model", STR),
] + COMPLETION_FIELDS

ANTHROPIC_BASE = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "Say hi"}]}
ANTHROPIC_FIELDS = [
    _f("messages", MESSAGES + [[{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "1", "content": "x"}]}],
                               [{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "data": "x"}}]}],
                               [{"role": "assistant", "content": [{"type": "tool_use", "id": "1", "name": "f", "input": 5}]}],
                               [{"role": "user", "content": [{"type": "thinking", "thinking": "x"}]}]]),
    _f("system", ["be brief", [{"type": "text", "text": "x"}], [{"type": "image"}], 5, [], {}, None, [5]]),
    _f("max_tokens", NUM), _f("stop_sequences", [["\n"], "x", 5, [5], [], None]), _f("stream", BOOL),
    _f("temperature", FLT), _f("top_p", FLT), _f("top_k", NUM),
    _f("tools", [[{"name": "f", "input_schema": {"type": "object"}}], [{"name": "f"}], [{}], "x", 5, [], None,
                 [{"type": "web_search_20250305", "name": "web_search"}]]),
    _f("tool_choice", [{"type": "auto"}, {"type": "any"}, {"type": "none"}, {"type": "tool", "name": "f"}, {"type": "bogus"},
                       "auto", 5, {}, None]),
    _f("thinking", [{"type": "enabled", "budget_tokens": 10}, {"type": "enabled", "budget_tokens": "x"},
                    {"type": "disabled"}, {"type": "bogus"}, "x", 5, {}, None]),
    _f("metadata", [{"user_id": "u"}, {"user_id": 5}, "x", 5, None]),
    _f("model", STR),
]

RESPONSES_BASE = {"input": "Say hi", "max_output_tokens": 4}
RESPONSES_FIELDS = [
    _f("input", ["", "hi", [], [{}], [{"role": "user", "content": "hi"}], [{"role": "user", "content": [{"type": "input_text"}]}],
                 [{"role": "user", "content": [{"type": "input_image"}]}],
                 [{"role": "user", "content": [{"type": "input_file", "file_id": "x"}]}],
                 [{"role": "user", "content": [{"type": "bogus"}]}], [{"role": "assistant", "type": "message", "content": 5}],
                 [{"type": "function_call", "call_id": "1", "name": "f", "arguments": "{}"}],
                 [{"type": "function_call_output", "call_id": "1", "output": 5}], [{"type": "reasoning"}],
                 [{"role": 5, "content": "x"}], 5, None, {}, [5], [None]]),
    _f("instructions", STR), _f("previous_response_id", ["", "resp_1", 5, None]),
    _f("tools", [[{"type": "function", "name": "f", "parameters": {}}], [{"type": "function"}], [{"type": "web_search"}],
                 "x", 5, [], None, [{}]]),
    _f("max_output_tokens", NUM), _f("reasoning", [{"effort": "none"}, {"effort": 5}, "x", 5, {}, None]),
    _f("text", [{"format": {"type": "json_schema", "schema": {"type": "object"}}}, {"format": {"type": "bogus"}}, "x", 5, {}]),
    _f("stream", BOOL), _f("temperature", FLT), _f("store", BOOL), _f("tool_choice", TOOL_CHOICE),
]

INFILL_BASE = {"input_prefix": "def f(", "input_suffix": "):\n", "n_predict": 4}
INFILL_FIELDS = [
    _f("input_prefix", STR), _f("input_suffix", STR),
    _f("input_extra", [[{"filename": "a.py", "text": "x"}], [{"filename": 5}], [{}], "x", 5, [5], {}, None]),
    _f("prompt", PROMPTS),
] + COMPLETION_FIELDS

ROUTES = [
    Route("/completion", {"prompt": "Hello", "n_predict": 4}, [PROMPT_FIELD] + COMPLETION_FIELDS),
    Route("/completions", {"prompt": "Hello", "n_predict": 4}, [PROMPT_FIELD] + COMPLETION_FIELDS),
    Route("/v1/completions", {"prompt": "Hello", "max_tokens": 4}, [PROMPT_FIELD] + COMPLETION_FIELDS),
    Route("/v1/chat/completions", CHAT_BASE, CHAT_FIELDS),
    Route("/chat/completions", CHAT_BASE, CHAT_FIELDS),
    Route("/v1/chat/completions/input_tokens", CHAT_BASE, CHAT_FIELDS[:12]),
    Route("/apply-template", CHAT_BASE, CHAT_FIELDS[:12]),
    Route("/v1/messages", ANTHROPIC_BASE, ANTHROPIC_FIELDS),
    Route("/v1/messages/count_tokens", ANTHROPIC_BASE, ANTHROPIC_FIELDS),
    Route("/v1/responses", RESPONSES_BASE, RESPONSES_FIELDS),
    Route("/v1/responses/input_tokens", RESPONSES_BASE, RESPONSES_FIELDS),
    Route("/infill", INFILL_BASE, INFILL_FIELDS),
    Route("/tokenize", {"content": "Hello world"},
          [_f("content", PROMPTS), _f("add_special", BOOL), _f("parse_special", BOOL), _f("with_pieces", BOOL)]),
    Route("/detokenize", {"tokens": [2, 3, 4]}, [_f("tokens", TOKENS_BAD + WRONG + [[], [2] * 1000])]),
    Route("/embedding", {"content": "Hello"}, [_f("content", PROMPTS), _f("input", PROMPTS), _f("embd_normalize", NUM)]),
    Route("/v1/embeddings", {"input": "Hello"}, [_f("input", PROMPTS), _f("encoding_format", ["float", "base64", "x", 5])]),
    Route("/rerank", {"query": "q", "documents": ["a", "b"]},
          [_f("query", STR), _f("documents", [[], ["a"], [5], "x", 5, None]), _f("top_n", NUM), _f("texts", [["a"], 5])]),
    Route("/props", {"n_ctx": 5}, [_f("n_ctx", NUM), _f("x", WRONG)]),
    Route("/lora-adapters", [{"id": 0, "scale": 0.5}], []),
    Route("/slots/0", {"filename": "a.bin"}, [_f("filename", STR + ["a/b.bin", ".bin", "..", "a" * 300])],
          query=["action=save", "action=restore", "action=erase", "action=bogus", "", "action="]),
    Route("/slots/5", {"filename": "a.bin"}, [], query=["action=save", "action=erase"]),
    Route("/slots/x", {"filename": "a.bin"}, [], query=["action=erase"]),
    Route("/slots/-1", {"filename": "a.bin"}, [], query=["action=erase"]),
    Route("/v1/chat/completions/control", {"id": "chatcmpl-x", "action": "reasoning_end"},
          [_f("id", STR), _f("action", STR)]),
    Route("/v1/audio/transcriptions", {"file": "x"}, []),
    Route("/v1/systemone", {"questions": []}, []),
]

GET_ROUTES = ["/health", "/v1/health", "/models", "/v1/models", "/props", "/slots", "/slots?fail_on_no_slot=1",
              "/metrics", "/lora-adapters", "/v1/stream", "/props?model=x", "/health?x=%zz"]

UNKNOWN_PATHS = ["/nope", "/v2/completions", "/completion/", "//completion", "/completion%00", "/%", "/completion?x=1",
                 "/v1/chat/completions/", "/index.html/../completion", "/" + "a" * 9000, "/slots/0/x", "/tokenize/extra",
                 "/v1/models/x", "/COMPLETION"]


@dataclass
class Case:
    id: int
    key: str  # what the allow-list matches: "METHOD /route what"
    method: str = "POST"
    path: str = "/"
    # the bytes, or for the big ones what makes them when the case is sent
    body: bytes | Callable[[], bytes] | None = None
    headers: list[tuple[str, str]] = field(default_factory=list)
    wire: str = "http"  # http | slow | idle | abandon | abandon-stream | pipeline | raw
    raw: bytes | None = None
    # False when the bytes hold no well-formed request: no answer is then no hang, and a server
    # that waits for more is given less time
    complete: bool = True


def _short(v) -> str:
    s = json.dumps(v, ensure_ascii=True)
    if len(s) > 120:
        s = s[:100] + f"..({len(s)})"
    return s


def _set(body: dict, name: str, value) -> dict:
    b = dict(body)
    b[name] = value
    return b


def _deep(n: int, open_: str, close: str) -> bytes:
    return (open_ * n + close * n).encode()


BROKEN_BODIES = [
    (b"", "empty"), (b"{", "truncated"), (b"{\"prompt\": \"hi\"", "truncated-object"), (b"null", "null"),
    (b"[]", "array"), (b"5", "number"), (b"\"hi\"", "string"), (b"true", "bool"), (b"{}", "empty-object"),
    (b"{\"prompt\": \"hi\"} trailing", "trailing-garbage"), (b"{\"prompt\": \"\xff\xfe\"}", "invalid-utf8"),
    (b"\xef\xbb\xbf{\"prompt\": \"hi\"}", "bom"), (b"{\"prompt\": \"hi\", \"prompt\": 5}", "duplicate-key"),
    (b"{'prompt': 'hi'}", "single-quotes"), (b"{\"prompt\": NaN}", "nan"), (b"{\"prompt\": \"\\ud800\"}", "lone-surrogate"),
    (b"{\"prompt\": \"a\\u0000b\"}", "nul-escape"), (b"{\"n_predict\": 1e999}", "overflow-number"),
    (b"{\"n_predict\": -0}", "negative-zero"), (b"{\"n_predict\": 01}", "leading-zero"),
    (_deep(20000, "[", "]"), "deep-array"), (b"{\"a\":" * 20000 + b"1" + b"}" * 20000, "deep-object"),
    (b"{\"prompt\": " + _deep(5000, "[", "]") + b"}", "deep-prompt"), (b" \n\t{\"prompt\":\"hi\"}\n ", "whitespace"),
    (lambda: b"{\"prompt\": \"" + b"a" * 3_000_000 + b"\"}", "3MB-string"),
    (lambda: b"{\"x\": \"" + b"a" * 50_000_000 + b"\"}", "50MB-field"),
]


GARBAGE = [("tls-hello", b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03" + bytes(40)), ("word", b"HELLO\r\n\r\n"),
           ("method-only", b"GET\r\n\r\n"), ("http-9.9", b"GET / HTTP/9.9\r\n\r\n"), ("blank-lines", b"\r\n\r\n\r\n"),
           ("bad-header", b"GET /health HTTP/1.1\r\nbad header\r\n\r\n")]

# legitimate but large requests: (route, body made when sent, what)
BIG = [
    ("/tokenize", lambda: {"content": "hello " * 450_000}, "2.7MB-text"),
    ("/tokenize", lambda: {"content": "hello " * 450_000, "with_pieces": True}, "2.7MB-text-pieces"),
    ("/detokenize", lambda: {"tokens": [2] * 200_000}, "200k-tokens"),
    ("/completion", lambda: {"prompt": "hello " * 500_000, "n_predict": 2}, "3MB-prompt"),
    ("/v1/chat/completions", lambda: {"messages": [{"role": "user", "content": "x" * 2_000_000}], "max_tokens": 2}, "2MB-message"),
    ("/completion", lambda: {"prompt": "hi", "n_predict": 2, "x": "a" * 50_000_000}, "50MB-body"),
    ("/completion", lambda: {"prompt": "hi", "n_predict": 2, "x": "a" * 105_000_000}, "105MB-body"),
]


def generate(seed: int, n: int) -> list[Case]:
    rng = random.Random(seed)
    cases: list[Case] = []
    kinds = [("field", 62), ("fields", 10), ("body", 8), ("route", 6), ("get", 4), ("wire", 6), ("valid", 4), ("big", 0.3)]
    names = [k for k, _ in kinds]
    weights = [w for _, w in kinds]
    route_weights = [max(4, min(len(r.fields), 40)) for r in ROUTES]
    while len(cases) < n:
        i = len(cases)
        kind = rng.choices(names, weights)[0]
        route = rng.choices(ROUTES, route_weights)[0]
        base = route.base
        query = ("?" + rng.choice(route.query)) if route.query else ""
        path = route.path + query
        if kind in ("field", "fields") and route.fields and isinstance(base, dict):
            body = dict(base)
            if rng.random() < 0.25 and "messages" not in body and "input" not in body:
                body["stream"] = True
            descs = []
            for _ in range(1 if kind == "field" else rng.randint(2, 3)):
                f = rng.choice(route.fields)
                v = rng.choice(f.values)
                body = _set(body, f.name, v)
                descs.append(f"{f.name}={_short(v)}")
            cases.append(Case(i, f"POST {route.path} {' '.join(descs)}", path=path, body=json.dumps(body).encode()))
        elif kind == "body":
            raw, what = rng.choice(BROKEN_BODIES)
            if callable(raw) and rng.random() < 0.8:
                continue  # keep the big ones rare
            cases.append(Case(i, f"POST {route.path} body:{what}", path=path, body=raw))
        elif kind == "route":
            choice = rng.random()
            if choice < 0.4:
                p = rng.choice(UNKNOWN_PATHS)
                m = rng.choice(["GET", "POST"])
                cases.append(Case(i, f"{m} unknown {p[:40]}", method=m, path=p, body=b"{}" if m == "POST" else None))
            else:
                m = rng.choice(["GET", "PUT", "DELETE", "PATCH", "HEAD"])
                cases.append(Case(i, f"{m} {route.path} method", method=m, path=path,
                                  body=None if m in ("GET", "HEAD") else json.dumps(base).encode()))
        elif kind == "big":
            path, make, what = rng.choice(BIG)
            cases.append(Case(i, f"POST {path} big:{what}", path=path, body=lambda make=make: json.dumps(make()).encode()))
        elif kind == "get":
            p = rng.choice(GET_ROUTES)
            cases.append(Case(i, f"GET {p}", method="GET", path=p))
        elif kind == "wire":
            cases.append(_wire_case(rng, i, route, path))
        else:
            body = json.dumps(base).encode() if base is not None else None
            cases.append(Case(i, f"POST {route.path} valid", path=path, body=body))
    return cases


def _wire_case(rng: random.Random, i: int, route: Route, path: str) -> Case:
    body = json.dumps(route.base).encode()
    what = rng.choice(["slow", "idle", "abandon", "abandon-stream", "pipeline", "bad-length", "chunked", "http10",
                       "garbage", "long-header", "no-content-type", "text-content-type", "expect-continue", "short-length",
                       "bad-chunk"])
    key = f"WIRE {route.path} {what}"
    head = lambda extra, b=body: ("POST " + path + " HTTP/1.1\r\nHost: x\r\nConnection: close\r\n" + extra + "\r\n").encode() + b
    if what == "slow":
        return Case(i, key, path=path, body=body, wire="slow")
    if what == "idle":
        return Case(i, key, wire="idle", raw=b"POST " + path.encode() + b" HTTP/1.1\r\nHost: x\r\n")
    if what == "abandon":
        return Case(i, key, wire="abandon", raw=head(f"Content-Length: {len(body) + 100}\r\n"))
    if what == "abandon-stream":
        b = dict(route.base) if isinstance(route.base, dict) else {}
        b["stream"] = True
        b["n_predict"] = 64
        b["max_tokens"] = 64
        raw = json.dumps(b).encode()
        return Case(i, key, wire="abandon-stream", raw=head(f"Content-Length: {len(raw)}\r\n", raw))
    if what == "pipeline":
        one = ("GET /health HTTP/1.1\r\nHost: x\r\n\r\n").encode()
        last = head(f"Content-Length: {len(body)}\r\nContent-Type: application/json\r\n")
        return Case(i, key, wire="pipeline", raw=one + one + last)
    if what == "bad-length":
        return Case(i, key, wire="raw", raw=head("Content-Length: -5\r\n"))
    if what == "short-length":
        return Case(i, key, wire="raw", raw=head(f"Content-Length: {max(0, len(body) - 3)}\r\n"))
    if what == "chunked":
        chunked = f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n"
        return Case(i, key, wire="raw", raw=head("Transfer-Encoding: chunked\r\nContent-Type: application/json\r\n", chunked))
    if what == "bad-chunk":
        return Case(i, key, wire="raw", raw=head("Transfer-Encoding: chunked\r\n", b"zz\r\n" + body + b"\r\n0\r\n\r\n"))
    if what == "http10":
        return Case(i, key, wire="raw", raw=("POST " + path + " HTTP/1.0\r\n").encode()
                    + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    if what == "garbage":
        name, raw = rng.choice(GARBAGE)
        return Case(i, f"{key}:{name}", wire="raw", raw=raw, complete=False)
    if what == "long-header":
        return Case(i, key, wire="raw", raw=head(f"Content-Length: {len(body)}\r\nX-Long: {'a' * 70000}\r\n"))
    if what == "no-content-type":
        return Case(i, key, wire="raw", raw=head(f"Content-Length: {len(body)}\r\n"))
    if what == "text-content-type":
        return Case(i, key, wire="raw", raw=head(f"Content-Length: {len(body)}\r\nContent-Type: text/plain\r\n"))
    return Case(i, key, wire="raw", raw=head(f"Content-Length: {len(body)}\r\nExpect: 100-continue\r\n"))
