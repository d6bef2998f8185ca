"""What of an answer is compared between the two servers, and the allow-list of known differences.

Errors compare by status, type and message. Successful answers compare by status and by the shape
of their JSON (keys and value kinds, not values: sampling differs from run to run); event streams
by the set of event shapes and whether they end with `[DONE]`."""

from __future__ import annotations

import fnmatch
import json
from dataclasses import dataclass
from pathlib import Path

from .wire import Answer


def shape(v, depth: int = 0):
    if depth > 6:
        return "..."
    if isinstance(v, dict):
        return {k: shape(x, depth + 1) for k, x in sorted(v.items())}
    if isinstance(v, list):
        return [shape(v[0], depth + 1)] if v else []
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, (int, float)):
        return "num"
    if isinstance(v, str):
        return "str"
    return "null"


def _json(body: bytes):
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None


def _error(obj) -> dict | None:
    if isinstance(obj, dict) and isinstance(obj.get("error"), dict):
        e = obj["error"]
        return {"type": e.get("type"), "message": e.get("message")}
    return None


def summarize(a: Answer) -> dict:
    """The comparable part of one answer."""
    if a.status is None:
        return {"status": None, "failure": "timeout" if a.timed_out else (a.error or "no answer")}
    out: dict = {"status": a.status}
    ct = a.content_type
    if ct == "text/event-stream":
        events, done, errors = [], False, []
        for line in a.body.decode("utf-8", "replace").splitlines():
            if not line.startswith("data:") and not line.startswith("error:"):
                continue
            payload = line.split(":", 1)[1].strip()
            if payload == "[DONE]":
                done = True
                continue
            obj = _json(payload.encode())
            if _error(obj) or line.startswith("error:"):
                errors.append(_error(obj) or payload)
            elif obj is not None:
                s = json.dumps(shape(obj), sort_keys=True)
                if s not in events:
                    events.append(s)
        out["stream"] = {"done": done, "errors": errors, "n_shapes": len(events)}
        return out
    obj = _json(a.body) if a.body else None
    err = _error(obj)
    if err:
        out["error"] = err
    elif a.status >= 400:
        out["body"] = a.body[:300].decode("utf-8", "replace")
    elif obj is not None:
        out["shape"] = shape(obj)
    else:
        out["content_type"] = ct
    return out


def differences(u: dict, s: dict) -> list[str]:
    """How strata's summary differs from upstream's, in words; empty when they agree."""
    if u.get("status") != s.get("status"):
        return [f"status {u.get('status')} vs {s.get('status')}"]
    out = []
    if "error" in u or "error" in s:
        ue, se = u.get("error") or {}, s.get("error") or {}
        if ue.get("type") != se.get("type"):
            out.append(f"error type {ue.get('type')!r} vs {se.get('type')!r}")
        if ue.get("message") != se.get("message"):
            out.append("error message")
    if "body" in u or "body" in s:
        if u.get("body") != s.get("body"):
            out.append("body")
    if "shape" in u or "shape" in s:
        d = _shape_diff(u.get("shape"), s.get("shape"))
        if d:
            out.append("shape " + d)
    if "stream" in u or "stream" in s:
        us, ss = u.get("stream") or {}, s.get("stream") or {}
        if us.get("done") != ss.get("done"):
            out.append(f"stream [DONE] {us.get('done')} vs {ss.get('done')}")
        if bool(us.get("errors")) != bool(ss.get("errors")):
            out.append("stream errors")
    return out


def _shape_diff(a, b, path: str = "") -> str:
    """Where two shapes differ ("" where they agree); an empty list agrees with any list, since
    how many items a list holds is a value, not a shape."""
    if isinstance(a, dict) and isinstance(b, dict):
        only_a = sorted(set(a) - set(b))
        only_b = sorted(set(b) - set(a))
        if only_a or only_b:
            return f"at {path or '.'}: upstream-only {only_a[:6]} strata-only {only_b[:6]}"
        for k in a:
            d = _shape_diff(a[k], b[k], f"{path}.{k}")
            if d:
                return d
        return ""
    if isinstance(a, list) and isinstance(b, list):
        return _shape_diff(a[0], b[0], path + "[0]") if a and b else ""
    return "" if a == b else f"at {path or '.'}: {json.dumps(a)[:60]} vs {json.dumps(b)[:60]}"


@dataclass
class Allowed:
    pattern: str
    reason: str


def load_allow(path: Path) -> list[Allowed]:
    """`PATTERN | reason` lines; PATTERN is an fnmatch pattern over the case key."""
    out = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        pat, sep, reason = line.partition(" | ")
        if not sep or not reason.strip():
            raise SystemExit(f"{path}: every entry needs ' | reason': {line!r}")
        out.append(Allowed(pat.strip(), reason.strip()))
    return out


def allowed(key: str, allow: list[Allowed]) -> Allowed | None:
    for a in allow:
        if fnmatch.fnmatchcase(key, a.pattern):
            return a
    return None
