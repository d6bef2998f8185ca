"""The differential HTTP fuzzer's own parts: the same seed gives the same cases, answers are
parsed whatever their framing, the comparison sees what matters and the allow-list matches."""

from __future__ import annotations

from pathlib import Path

import pytest

from strata_tools.fuzz_http import cases, compare, wire


def test_a_seed_gives_the_same_cases():
    def fixed(c):
        # big bodies are made when sent; their key names them
        return c.key, "made when sent" if callable(c.body) else c.body, c.raw

    a = cases.generate(5, 300)
    b = cases.generate(5, 300)
    assert [fixed(c) for c in a] == [fixed(c) for c in b]
    assert [c.key for c in cases.generate(6, 300)] != [c.key for c in a]


def test_every_route_and_kind_is_reached():
    keys = [c.key for c in cases.generate(1, 3000)]
    for route in cases.ROUTES:
        assert any(f" {route.path} " in k or k.endswith(f" {route.path}") for k in keys), route.path
    for prefix in ("POST", "GET", "WIRE", "PUT", "DELETE"):
        assert any(k.startswith(prefix) for k in keys), prefix
    assert any("big:" in k for k in keys) and any("body:" in k for k in keys)


def test_answers_parse_with_length_chunked_and_pipelined_framing():
    plain = b"HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"
    chunked = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"
    a = wire.parse(plain)
    assert (a.status, a.content_type, a.body) == (400, "application/json", b"{}")
    a, rest = wire.parse_one(chunked + plain)
    assert (a.status, a.body) == (200, b"abcde")
    assert wire.parse(rest).status == 400
    assert wire.parse(b"garbage").status is None


def test_errors_compare_by_status_type_and_message_successes_by_shape():
    def ans(status, body):
        return wire.Answer(status=status, headers={"content-type": "application/json"}, body=body.encode())

    same = compare.summarize(ans(400, '{"error":{"code":400,"type":"invalid_request_error","message":"x"}}'))
    other = compare.summarize(ans(400, '{"error":{"code":400,"type":"invalid_request_error","message":"y"}}'))
    assert compare.differences(same, same) == []
    assert compare.differences(same, other) == ["error message"]
    one = compare.summarize(ans(200, '{"content":"a","n":1}'))
    two = compare.summarize(ans(200, '{"content":"bcd","n":2.5}'))
    assert compare.differences(one, two) == []
    three = compare.summarize(ans(200, '{"content":"a"}'))
    assert compare.differences(one, three)[0].startswith("shape")
    assert compare.differences(one, compare.summarize(ans(500, "{}"))) == ["status 200 vs 500"]
    # how many items a list holds is a value: an empty list agrees with any list
    empty, full = compare.summarize(ans(200, '{"l":[]}')), compare.summarize(ans(200, '{"l":[{"a":1}]}'))
    assert compare.differences(empty, full) == []
    assert compare.differences(full, compare.summarize(ans(200, '{"l":[{"b":1}]}')))[0].startswith("shape at .l[0]")


def test_the_allow_list_needs_a_reason_and_matches_keys(tmp_path):
    good = tmp_path / "allow.txt"
    good.write_text("# comment\nPOST * body:deep-* | a reason\n")
    allow = compare.load_allow(good)
    assert compare.allowed("POST /completion body:deep-array", allow)
    assert not compare.allowed("POST /completion body:empty", allow)
    bad = tmp_path / "bad.txt"
    bad.write_text("POST * body:deep-*\n")
    with pytest.raises(SystemExit):
        compare.load_allow(bad)


def test_the_committed_allow_list_loads():
    compare.load_allow(Path(cases.__file__).with_name("allow.txt"))
