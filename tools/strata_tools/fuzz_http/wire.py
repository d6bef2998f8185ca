"""HTTP/1.1 over a plain socket, so that a case can send exactly the bytes it means (bad framing,
slow or partial writes, early disconnects) and read whatever comes back, however malformed."""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass, field


@dataclass
class Answer:
    """What one request got back. `status` is None when nothing parseable arrived."""

    status: int | None = None
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    timed_out: bool = False
    error: str = ""
    seconds: float = 0.0

    @property
    def content_type(self) -> str:
        return self.headers.get("content-type", "").split(";")[0].strip()


def request_bytes(method: str, path: str, body: bytes | None, headers: list[tuple[str, str]] | None = None,
                  version: str = "HTTP/1.1", close: bool = True) -> bytes:
    lines = [f"{method} {path} {version}", "Host: 127.0.0.1"]
    names = {k.lower() for k, _ in headers or []}
    for k, v in headers or []:
        lines.append(f"{k}: {v}")
    if body is not None and "content-length" not in names and "transfer-encoding" not in names:
        lines.append(f"Content-Length: {len(body)}")
    if body is not None and "content-type" not in names:
        lines.append("Content-Type: application/json")
    if close and "connection" not in names:
        lines.append("Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1", "replace") + (body or b"")


def _dechunk(data: bytes) -> tuple[bytes, bytes]:
    """The body of a chunked message and what follows it."""
    out = bytearray()
    pos = 0
    while pos < len(data):
        end = data.find(b"\r\n", pos)
        if end < 0:
            break
        try:
            size = int(data[pos:end].split(b";")[0], 16)
        except ValueError:
            break
        if size == 0:
            trailer = data.find(b"\r\n\r\n", end)
            return bytes(out), data[trailer + 4:] if trailer >= 0 else b""
        out += data[end + 2:end + 2 + size]
        pos = end + 2 + size + 2
    return bytes(out), b""


def parse_one(raw: bytes) -> tuple[Answer, bytes]:
    """The first response in `raw` and the bytes after it."""
    head, sep, rest = raw.partition(b"\r\n\r\n")
    if not sep:
        return Answer(error="no complete response head" if raw else "no response"), b""
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    try:
        status = int(parts[1])
    except (IndexError, ValueError):
        return Answer(error=f"bad status line {lines[0][:80]!r}"), b""
    headers = {}
    for line in lines[1:]:
        k, _, v = line.partition(":")
        headers[k.strip().lower()] = v.strip()
    after = b""
    if headers.get("transfer-encoding", "").lower() == "chunked":
        body, after = _dechunk(rest)
    elif "content-length" in headers:
        try:
            n = int(headers["content-length"])
            body, after = rest[:n], rest[n:]
        except ValueError:
            body = rest
    else:
        body = rest
    return Answer(status=status, headers=headers, body=body), after


def parse(raw: bytes) -> Answer:
    return parse_one(raw)[0]


def _connect(port: int, timeout: float) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def _read_all(s: socket.socket, deadline: float) -> tuple[bytes, bool]:
    chunks = []
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return b"".join(chunks), True
        s.settimeout(min(left, 5.0))
        try:
            data = s.recv(65536)
        except socket.timeout:
            continue
        except OSError:
            return b"".join(chunks), False
        if not data:
            return b"".join(chunks), False
        chunks.append(data)


def exchange(port: int, data: bytes, timeout: float, pieces: int = 1, gap: float = 0.0) -> Answer:
    """Sends `data` (in `pieces` writes `gap` seconds apart), then reads until the server closes."""
    t0 = time.monotonic()
    deadline = t0 + timeout
    try:
        s = _connect(port, timeout)
    except OSError as e:
        return Answer(error=f"connect: {e}", seconds=time.monotonic() - t0)
    with s:
        try:
            step = max(1, -(-len(data) // pieces))
            for i in range(0, len(data), step):
                s.sendall(data[i:i + step])
                if gap:
                    time.sleep(gap)
        except OSError as e:
            # the server may answer and close before the whole body is sent (413, 400)
            raw, timed_out = _read_all(s, deadline)
            a = parse(raw) if raw else Answer(error=f"send: {e}")
            a.seconds = time.monotonic() - t0
            return a
        raw, timed_out = _read_all(s, deadline)
    a = parse(raw)
    a.timed_out = timed_out
    a.seconds = time.monotonic() - t0
    return a


def abandon(port: int, data: bytes, read_first: int = 0, hold: float = 0.0) -> str:
    """Sends `data`, optionally reads `read_first` bytes of the answer, waits `hold` seconds and
    closes the connection without reading the rest: a client that goes away."""
    try:
        s = _connect(port, 10)
    except OSError as e:
        return f"connect: {e}"
    with s:
        try:
            s.sendall(data)
            got = 0
            s.settimeout(30)
            while got < read_first:
                d = s.recv(read_first - got)
                if not d:
                    break
                got += len(d)
            if hold:
                time.sleep(hold)
        except OSError as e:
            return f"{type(e).__name__}"
        # RST instead of FIN, as a killed client leaves it
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    return "closed"


def pipeline(port: int, requests: list[bytes], timeout: float) -> list[Answer]:
    """Several requests written at once on one keep-alive connection; the answers in order."""
    t0 = time.monotonic()
    try:
        s = _connect(port, timeout)
    except OSError as e:
        return [Answer(error=f"connect: {e}")]
    with s:
        try:
            s.sendall(b"".join(requests))
        except OSError as e:
            return [Answer(error=f"send: {e}")]
        raw, timed_out = _read_all(s, t0 + timeout)
    answers = []
    while raw:
        a, raw = parse_one(raw)
        answers.append(a)
        if a.status is None:
            break
    if timed_out:
        answers.append(Answer(timed_out=True, error="timed out"))
    return answers
