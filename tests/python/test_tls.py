"""HTTPS with --ssl-key-file/--ssl-cert-file, the same tests against strata-server and upstream
llama-server built with OpenSSL (tools/build-upstream): curl with --cacert, the OpenAI client with a
custom CA, a streamed chat, keep-alive, the API key gate and CORS over TLS, plain HTTP to the TLS port,
and start-up with a bad, missing or mismatched key or certificate. The certificates are made here."""

from __future__ import annotations

import http.client
import json
import os
import shutil
import socket
import ssl
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
BINARIES = {"strata": STRATA, "upstream": UPSTREAM}
KEY = "secret-key-1"


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    """A CA, a server certificate it signed for localhost and 127.0.0.1, a second key, an RSA pair."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is not installed (tools/setup installs it)")
    d = tmp_path_factory.mktemp("pki")
    openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", "ca.key",
            "-out", "ca.pem", "-days", "2", "-subj", "/CN=Strata test CA", cwd=d)
    openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", "server.key",
            "-out", "server.csr", "-subj", "/CN=localhost", cwd=d)
    (d / "san.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-out",
            "server.pem", "-days", "2", "-extfile", "san.ext", cwd=d)
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "rsa.key", "-out", "rsa.pem", "-days", "2",
            "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1", cwd=d)
    openssl("genpkey", "-algorithm", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-out", "other.key", cwd=d)
    (d / "junk.pem").write_text("not a certificate\n")
    return d


def binary(name: str) -> Path:
    b = BINARIES[name]
    if not b.exists() or not MODEL.exists():
        pytest.skip(f"{b} or the Gemma model is not built (run tools/setup and tools/build-upstream)")
    return b


def ctx(ca: Path) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(ca))


def start_tls(name: str, key: Path, cert: Path, ca: Path, extra: list[str] = ()) -> tuple[subprocess.Popen, int]:
    port = servers.free_port()
    args = [str(binary(name)), "-m", str(MODEL), "-c", "1024", "-np", "2", "--port", str(port),
            "--ssl-key-file", str(key), "--ssl-cert-file", str(cert), *extra]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while True:
        if proc.poll() is not None:
            pytest.fail(f"{name} exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"https://localhost:{port}/health", timeout=5, context=ctx(ca)) as r:
                if json.load(r).get("status") == "ok":
                    return proc, port
        except (OSError, ValueError):
            pass
        if time.time() > deadline:
            proc.kill()
            pytest.fail(f"{name} not ready over HTTPS in 120 s")
        time.sleep(0.2)


@pytest.fixture(scope="module", params=sorted(BINARIES))
def tls_server(request, pki):
    proc, port = start_tls(request.param, pki / "server.key", pki / "server.pem", pki / "ca.pem", ["--api-key", KEY])
    yield request.param, port
    proc.terminate()
    proc.wait(timeout=30)


def test_curl_with_the_ca_and_without_it(tls_server, pki):
    _, port = tls_server
    ok = subprocess.run(["curl", "-sS", "--cacert", str(pki / "ca.pem"), f"https://localhost:{port}/health"],
                        capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and json.loads(ok.stdout) == {"status": "ok"}, ok.stderr
    # the system's CAs do not know this one: curl refuses the certificate (exit 60)
    bad = subprocess.run(["curl", "-sS", f"https://localhost:{port}/health"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 60, (bad.returncode, bad.stderr)


def test_openai_client_with_a_custom_ca_plain_and_streamed(tls_server, pki):
    openai = pytest.importorskip("openai")
    httpx = pytest.importorskip("httpx")
    _, port = tls_server
    client = openai.OpenAI(base_url=f"https://localhost:{port}/v1", api_key=KEY,
                           http_client=httpx.Client(verify=str(pki / "ca.pem")))
    msgs = [{"role": "user", "content": "Name a colour."}]
    plain = client.chat.completions.create(model="any", messages=msgs, max_tokens=8, temperature=0)
    text = plain.choices[0].message.content
    assert plain.usage.completion_tokens > 0
    chunks = list(client.chat.completions.create(model="any", messages=msgs, max_tokens=8, temperature=0, stream=True))
    assert len(chunks) > 2
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"https://localhost:{port}/v1", api_key="wrong",
                      http_client=httpx.Client(verify=str(pki / "ca.pem"))).models.list()


def test_keep_alive_api_key_and_cors_over_tls(tls_server, pki):
    _, port = tls_server
    conn = http.client.HTTPSConnection("localhost", port, context=ctx(pki / "ca.pem"), timeout=60)

    def ask(method, path, body=None, headers=None):
        conn.request(method, path, body, headers or {})
        r = conn.getresponse()
        return r, r.read()

    r, body = ask("GET", "/health")
    assert r.status == 200 and json.loads(body) == {"status": "ok"}
    sock = conn.sock
    auth = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"}
    r, body = ask("POST", "/completion", json.dumps({"prompt": "Hello", "n_predict": 2}), auth)
    assert r.status == 200 and json.loads(body)["tokens_predicted"] == 2
    r, _ = ask("OPTIONS", "/v1/chat/completions", headers={"Origin": "http://example.com", "Access-Control-Request-Method": "POST"})
    assert r.status == 200 and r.getheader("Access-Control-Allow-Origin") == "http://example.com"
    assert conn.sock is sock, "the connection was not kept alive"
    # a refused key: 401, and the client can go on (on this connection, or on a new one where the answer said close)
    r, body = ask("POST", "/completion", json.dumps({"prompt": "Hello", "n_predict": 2}), {"Content-Type": "application/json"})
    assert r.status == 401, body
    r, body = ask("GET", "/health")
    assert r.status == 200
    conn.close()


def test_plain_http_to_the_tls_port_gets_no_http_answer(tls_server):
    _, port = tls_server
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
        got = b""
        try:
            while chunk := s.recv(4096):
                got += chunk
        except (ConnectionResetError, TimeoutError):
            pass
    assert not got.startswith(b"HTTP/"), got[:200]
    with pytest.raises((urllib.error.URLError, http.client.HTTPException, ConnectionError)):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=30)


@pytest.mark.parametrize("name", sorted(BINARIES))
def test_an_rsa_pair_serves(name, pki):
    proc, port = start_tls(name, pki / "rsa.key", pki / "rsa.pem", pki / "rsa.pem")
    proc.terminate()
    proc.wait(timeout=30)


@pytest.mark.parametrize("name", sorted(BINARIES))
@pytest.mark.parametrize("case", ["missing key", "missing cert", "mismatched key", "junk cert", "key as cert"])
def test_a_bad_key_or_certificate_stops_start_up(name, case, pki):
    key, cert = {
        "missing key": (pki / "nope.key", pki / "server.pem"),
        "missing cert": (pki / "server.key", pki / "nope.pem"),
        "mismatched key": (pki / "other.key", pki / "server.pem"),
        "junk cert": (pki / "server.key", pki / "junk.pem"),
        "key as cert": (pki / "server.key", pki / "server.key"),
    }[case]
    port = servers.free_port()
    out = subprocess.run([str(binary(name)), "-m", str(MODEL), "--port", str(port), "--ssl-key-file", str(key),
                          "--ssl-cert-file", str(cert)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stderr[-2000:]
    assert f"E srv         start: couldn't bind HTTP server socket, hostname: 127.0.0.1, port: {port}" in out.stderr, out.stderr[-2000:]
    assert "E srv  llama_server: exiting due to HTTP server error" in out.stderr, out.stderr[-2000:]
    assert "model loaded" not in out.stderr
