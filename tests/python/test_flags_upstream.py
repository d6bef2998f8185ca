"""llama-server options strata-server honours, each shown side by side with upstream llama-server
from the same pin: both servers get the same flags, model and requests and must give the same
answers, and each test also checks what the flag changes, so that a strata-server that ignored
the flag would fail it. One server pair per group of flags that do not interfere."""

from __future__ import annotations

import contextlib
import http.server
import json
import math
import os
import struct
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

import servers

REPO = Path(__file__).resolve().parents[2]
STRATA = Path(os.environ.get("STRATA_SERVER", REPO / "target" / "release" / "strata-server"))
UPSTREAM = Path(os.environ.get("STRATA_UPSTREAM_SERVER", REPO / "target" / "upstream" / "bin" / "llama-server"))
MODELS = Path(os.environ.get("STRATA_MODELS", REPO / ".cache" / "models"))
TEMPLATES = REPO / "vendor" / "llama.cpp" / "models" / "templates"
STARTUP_S = 180


def model(name: str) -> str:
    p = MODELS / name
    if not p.is_file():
        pytest.fail(f"{p} is missing: run tools/setup")
    return str(p)


def template(name: str) -> str:
    return str(TEMPLATES / f"{name}.jinja")


class Server:
    """One running server: its base URL (with any --api-prefix), its stderr log."""

    def __init__(self, binary: Path, args: list[str], env: dict | None, prefix: str, headers: dict):
        self.name = binary.name
        self.port = servers.free_port()
        self.log_file = tempfile.NamedTemporaryFile(prefix=f"{self.name}-", suffix=".log", delete=False)
        self.proc = subprocess.Popen([str(binary), *args, "--port", str(self.port)], stdout=subprocess.DEVNULL,
                                     stderr=self.log_file, env={**os.environ, **(env or {})})
        self.root = f"http://127.0.0.1:{self.port}"
        self.url = self.root + prefix
        self.headers = headers

    def wait_ready(self):
        deadline = time.time() + STARTUP_S
        while True:
            if self.proc.poll() is not None:
                pytest.fail(f"{self.name} exited with {self.proc.returncode} before it was ready:\n{self.log()[-3000:]}")
            status, body, _ = self.request("GET", "/health")
            if status == 200 and isinstance(body, dict) and body.get("status") == "ok":
                return
            if time.time() > deadline:
                pytest.fail(f"{self.name} not ready in {STARTUP_S} s")
            time.sleep(0.2)

    def request(self, method: str, path: str, body=None, headers: dict | None = None, root: bool = False):
        """(status, JSON or text body, headers); connection errors read as status 0."""
        data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
        hdrs = {"Content-Type": "application/json", **self.headers, **(headers or {})}
        req = urllib.request.Request((self.root if root else self.url) + path, data=data, method=method, headers=hdrs)
        try:
            with urllib.request.urlopen(req, timeout=300) as r:
                status, raw, h = r.status, r.read(), r.headers
        except urllib.error.HTTPError as e:
            status, raw, h = e.code, e.read(), e.headers
        except OSError:
            return 0, None, {}
        try:
            return status, json.loads(raw), h
        except ValueError:
            return status, raw.decode(errors="replace"), h

    def get(self, path: str):
        return self.request("GET", path)[:2]

    def post(self, path: str, body):
        status, answer, _ = self.request("POST", path, body)
        assert status == 200, (self.name, path, answer)
        return answer

    def log(self) -> str:
        return Path(self.log_file.name).read_text(errors="replace")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log_file.close()
        os.unlink(self.log_file.name)


@contextlib.contextmanager
def pair(*args: str, env: dict | None = None, prefix: str = "", headers: dict | None = None,
         upstream_env: dict | None = None, upstream_args: list[str] | None = None):
    """strata-server and llama-server started together with the same flags (or upstream's own
    args and environment where a path must differ); stopped on exit."""
    for p in (STRATA, UPSTREAM):
        if not p.exists():
            pytest.fail(f"{p} is missing: build it (cargo build --release, tools/build-upstream)")
    started = []
    try:
        for binary, a, e in ((STRATA, list(args), env), (UPSTREAM, upstream_args or list(args), upstream_env or env)):
            started.append(Server(binary, a, e, prefix, headers or {}))
        for s in started:
            s.wait_ready()
        yield started[0], started[1]
    finally:
        for s in started:
            s.stop()


def both(s: Server, u: Server, method: str, path: str, body=None, headers: dict | None = None):
    """The same request to both servers; asserts equal status and body and returns them."""
    a = s.request(method, path, body, headers)
    b = u.request(method, path, body, headers)
    assert (a[0], unmarked(a[1])) == (b[0], unmarked(b[1])), f"{method} {path}\nstrata:   {a[:2]}\nupstream: {b[:2]}"
    return a


def unmarked(body):
    """/props without its media_marker, a random string per process, and its build_info (Strata's
    names Strata's version and commit after the pin's build)."""
    return {k: v for k, v in body.items() if k not in ("media_marker", "build_info")} if isinstance(body, dict) else body


def greedy(s: Server, u: Server, path: str, body: dict, keys: tuple[str, ...]):
    """A greedy request to both servers; the answers must agree on keys (dotted for nested)."""
    body = {"temperature": 0, **body}
    a, b = s.post(path, body), u.post(path, body)
    for k in keys:
        assert dig(a, k) == dig(b, k), f"{path} {k}\nstrata:   {dig(a, k)!r}\nupstream: {dig(b, k)!r}"
    if body.get("n_probs"):
        la, lb = ([t["logprob"] for p in r["completion_probabilities"] for t in p["top_logprobs"]] for r in (a, b))
        assert la == pytest.approx(lb, abs=1e-4), path
    return a


def same_props(s: Server, u: Server, *keys: str) -> dict:
    """GET /props of both; the keys (dotted for nested) must agree. Returns strata-server's."""
    a, b = s.get("/props"), u.get("/props")
    assert a[0] == b[0] == 200, (a, b)
    for k in keys:
        assert dig(a[1], k) == dig(b[1], k), f"/props {k}\nstrata:   {dig(a[1], k)!r}\nupstream: {dig(b[1], k)!r}"
    return a[1]


def dig(v, dotted: str):
    for part in dotted.split("."):
        v = v[int(part)] if isinstance(v, list) else v.get(part) if isinstance(v, dict) else None
    return v


def start_fails(*args: str, env: dict | None = None, upstream_env: dict | None = None, timeout: float = 120) -> list[tuple[int | None, str]]:
    """Both servers started with flags that must stop them: (exit status, stderr) of each; None
    for one still running after timeout seconds."""
    out = []
    for binary, e in ((STRATA, env), (UPSTREAM, upstream_env or env)):
        try:
            p = subprocess.run([str(binary), *args, "--port", str(servers.free_port())], capture_output=True, text=True,
                               timeout=timeout, env={**os.environ, **(e or {})}, stdin=subprocess.DEVNULL)
            out.append((p.returncode, p.stderr))
        except subprocess.TimeoutExpired as t:
            out.append((None, (t.stderr or b"").decode(errors="replace") + f"\n(still running after {timeout} s)"))
    return out


# --- HTTP front: prefix, keys, props, UI settings, the default n_predict, slot choice ----------

def test_prefix_keys_props_ui_config_predict_and_slot_similarity(tmp_path):
    keys = tmp_path / "keys.txt"
    keys.write_text("# c\nk1\n")
    auth = {"Authorization": "Bearer k1"}
    with pair("-m", model("tiny-llama.gguf"), "-c", "512", "-np", "2", "-n", "5", "--api-prefix", "/api",
              "--api-key-file", str(keys), "--props", "--ui-config", '{"theme":"dark"}', "-sps", "0.5",
              prefix="/api", headers=auth) as (s, u):
        # --api-prefix: the routes live under /api only; --api-key-file: "# c" is a comment, k1 a key
        for path, hdrs in (("/health", {}), ("/health", {"Authorization": ""}), ("/v1/health", {"Authorization": ""}),
                           ("/props", {"Authorization": "Bearer c"}), ("/props", {"Authorization": "Bearer # c"}),
                           ("/props", {"X-Api-Key": "k1", "Authorization": ""})):
            both(s, u, "GET", path, headers=hdrs)
        for path in ("/health", "/props", "/completion"):
            a = s.request("GET", path, root=True)
            b = u.request("GET", path, root=True)
            assert a[:2] == b[:2] and a[0] == 404, (path, a[:2], b[:2])
        status, body, _ = s.request("GET", "/props", headers={"Authorization": ""})
        assert status == 401 and body["error"]["type"] == "authentication_error", body
        # --props: POST /props is allowed; --ui-config: the settings come back in /props
        both(s, u, "POST", "/props", {})
        props = same_props(s, u, "endpoint_props", "ui_settings", "total_slots")
        assert props["endpoint_props"] is True and props["ui_settings"] == {"theme": "dark"}, props
        # -n 5: a request without n_predict stops after 5 tokens
        a = greedy(s, u, "/completion", {"prompt": "Once upon a time"}, ("content", "tokens_predicted", "stop_type"))
        assert (a["tokens_predicted"], a["stop_type"]) == (5, "limit"), a
        # -sps 0.5: a prompt sharing a third with the newest slot's is below the similarity bar, so
        # it goes to the least recently used slot instead of the one it shares tokens with (0.1 would)
        first = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu"
        second = "one two three four five six seven eight nine ten eleven twelve"
        third = "one two three four five six purple orange green yellow blue red black white grey"
        ids = [greedy(s, u, "/completion", {"prompt": p, "n_predict": 1}, ("id_slot", "tokens_cached"))["id_slot"]
               for p in (first, second, third)]
        assert ids[0] != ids[1] and ids[2] == ids[0], ids


def test_cors_methods_headers_credentials_ui_config_file_and_no_agent(tmp_path):
    ui = tmp_path / "ui.json"
    ui.write_text('{"theme":"light","n":3}')
    # -no-ag takes back the tools --tools gave, and with them the localhost-only CORS default
    with pair("-m", model("tiny-llama.gguf"), "-c", "256", "-np", "1", "--cors-methods", "GET",
              "--cors-headers", "Authorization", "--no-cors-credentials", "--ui-config-file", str(ui),
              "--tools", "all", "-no-ag") as (s, u):
        cors = ("Access-Control-Allow-Origin", "Access-Control-Allow-Credentials", "Access-Control-Allow-Methods",
                "Access-Control-Allow-Headers")
        for method, path in (("OPTIONS", "/completions"), ("OPTIONS", "/v1/chat/completions"), ("GET", "/health")):
            a = s.request(method, path, headers={"Origin": "http://example.com"})
            b = u.request(method, path, headers={"Origin": "http://example.com"})
            got = {h: a[2].get(h) for h in cors}
            assert a[0] == b[0] and got == {h: b[2].get(h) for h in cors}, (method, path, got, b[2])
            if method == "OPTIONS":
                assert got == {"Access-Control-Allow-Origin": "*", "Access-Control-Allow-Credentials": "false",
                               "Access-Control-Allow-Methods": "GET", "Access-Control-Allow-Headers": "Authorization"}, got
        props = same_props(s, u, "ui_settings", "cors_proxy_enabled")
        assert props["ui_settings"] == {"theme": "light", "n": 3} and props["cors_proxy_enabled"] is False, props
        assert both(s, u, "GET", "/tools")[0] == 403


def test_an_invalid_ui_config_stops_the_start():
    for status, err in start_fails("-m", model("tiny-llama.gguf"), "-c", "256", "--ui-config", "{bad", timeout=15):
        assert status == 1 and "failed to parse UI config" in err, (status, err[-2000:])


# --- chat templates and reasoning ------------------------------------------------------------

def test_template_kwargs_reasoning_effort_and_no_prefill_assistant():
    with pair("-m", model("tiny-llama.gguf"), "-c", "256", "-np", "1", "--chat-template-file", template("openai-gpt-oss-120b"),
              "--chat-template-kwargs", '{"model_identity":"You are Strata."}', "--reasoning-effort", "high",
              "--no-prefill-assistant") as (s, u):
        user = [{"role": "user", "content": "hi"}]
        prompt = both(s, u, "POST", "/apply-template", {"messages": user})[1]["prompt"]
        assert "You are Strata." in prompt and "Reasoning: high" in prompt, prompt
        # the request's own kwargs and effort go over the flags'
        prompt = both(s, u, "POST", "/apply-template", {"messages": user, "reasoning_effort": "low",
                                                        "chat_template_kwargs": {"model_identity": "You are X."}})[1]["prompt"]
        assert "You are X." in prompt and "Reasoning: low" in prompt, prompt
        # --no-prefill-assistant: a trailing assistant message is a finished turn, and a new one opens
        turn = user + [{"role": "assistant", "content": "PARTIAL"}]
        prompt = both(s, u, "POST", "/apply-template", {"messages": turn})[1]["prompt"]
        assert prompt.endswith("<|start|>assistant"), prompt
        assert "PARTIAL" in prompt, prompt


def test_no_reasoning_preserve_drops_earlier_reasoning():
    with pair("-m", model("tiny-llama.gguf"), "-c", "256", "-np", "1", "--chat-template-file", template("GLM-4.7-Flash"),
              "--no-reasoning-preserve") as (s, u):
        assert same_props(s, u, "chat_template_caps")["chat_template_caps"]["supports_preserve_reasoning"]
        turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello", "reasoning_content": "THOUGHT-ONE"},
                 {"role": "user", "content": "again"}]
        prompt = both(s, u, "POST", "/apply-template", {"messages": turns})[1]["prompt"]
        assert "THOUGHT-ONE" not in prompt and "hello" in prompt, prompt
        prompt = both(s, u, "POST", "/apply-template", {"messages": turns, "chat_template_kwargs": {"preserve_reasoning": True}})[1]["prompt"]
        assert "THOUGHT-ONE" in prompt, prompt


CHAT = {"messages": [{"role": "user", "content": "hi there"}], "max_tokens": 12}
MESSAGE = ("choices.0.message.content", "choices.0.message.reasoning_content", "usage.completion_tokens")


def test_reasoning_format_none_and_reasoning_budget_with_its_message():
    # the StarCoder tokenizer gives "<think>" the same tokens inside the prompt and alone, which
    # the reasoning budget's start matcher needs (SentencePiece and Qwen2's merges do not)
    with pair("-m", model("tiny-llama-fim.gguf"), "-c", "256", "-np", "1", "--chat-template-file", template("Qwen3.5-4B"),
              "--reasoning-format", "none", "--reasoning-budget", "2", "--reasoning-budget-message", " Done.") as (s, u):
        raw = greedy(s, u, "/v1/chat/completions", CHAT, MESSAGE)["choices"][0]["message"]
        assert "reasoning_content" not in raw and raw["content"].startswith("<think>\n") and " Done." in raw["content"], raw
        split = greedy(s, u, "/v1/chat/completions", {**CHAT, "reasoning_format": "deepseek"}, MESSAGE)["choices"][0]["message"]
        assert split.get("reasoning_content"), split
        longer = greedy(s, u, "/v1/chat/completions", {**CHAT, "reasoning_budget_tokens": 6}, MESSAGE)["choices"][0]["message"]
        assert longer["content"].index(" Done.") > raw["content"].index(" Done."), (raw, longer)


def test_skip_chat_parsing_and_spm_infill():
    with pair("-m", model("tiny-llama-fim.gguf"), "-c", "256", "-np", "1", "--chat-template-file", template("Qwen3.5-4B"),
              "--skip-chat-parsing", "--spm-infill") as (s, u):
        msg = greedy(s, u, "/v1/chat/completions", CHAT, MESSAGE)["choices"][0]["message"]
        assert "reasoning_content" not in msg and msg["content"], msg
        split = greedy(s, u, "/v1/chat/completions", {**CHAT, "reasoning_format": "deepseek"}, MESSAGE)["choices"][0]["message"]
        assert "reasoning_content" not in split, split
        # --spm-infill: suffix before prefix
        infill = {"input_prefix": "def add(a, b):\n    ", "input_suffix": "\n    return c\n", "n_predict": 4, "return_tokens": True}
        a = greedy(s, u, "/infill", infill, ("prompt", "tokens_evaluated", "tokens", "content"))
        assert a["prompt"] == "<fim_suffix>\n    return c\n<fim_prefix>def add(a, b):\n    <fim_middle>", a["prompt"]


# --- embeddings, adapters, context shift -----------------------------------------------------

def test_embd_normalize_sets_the_default_normalisation():
    with pair("-m", model("tiny-bert-embd.gguf"), "-c", "256", "-np", "1", "--embeddings", "--pooling", "mean",
              "--embd-normalize", "-1") as (s, u):
        for body, norm_is_one in (({"input": "hello world"}, False), ({"input": "hello world", "embd_normalize": 2}, True)):
            a, b = s.post("/v1/embeddings", body), u.post("/v1/embeddings", body)
            va, vb = a["data"][0]["embedding"], b["data"][0]["embedding"]
            assert va == pytest.approx(vb, rel=1e-4, abs=1e-5)
            norm = math.sqrt(sum(x * x for x in va))
            assert (abs(norm - 1) < 1e-3) == norm_is_one, (body, norm)


def test_lora_scaled_applies_the_adapter_at_its_scale():
    with pair("-m", model("tiny-llama.gguf"), "-c", "256", "-np", "1",
              "--lora-scaled", f"{model('tiny-llama-lora.gguf')}:0.5") as (s, u):
        adapters = both(s, u, "GET", "/lora-adapters")[1]
        assert [a["scale"] for a in adapters] == [0.5], adapters
        body = {"prompt": "hello", "n_predict": 4, "n_probs": 2, "return_tokens": True}
        scaled = greedy(s, u, "/completion", body, ("tokens", "content"))
        # the same request with the adapter off, to show that the flag's scale reached the model
        base = greedy(s, u, "/completion", {**body, "lora": [{"id": 0, "scale": 0}]}, ("tokens", "content"))
        assert scaled["tokens"] != base["tokens"], (scaled["tokens"], base["tokens"])


def test_keep_is_the_default_n_keep_of_the_context_shift():
    with pair("-m", model("tiny-llama.gguf"), "-c", "256", "-np", "1", "--context-shift", "--keep", "4") as (s, u):
        prompt = " ".join(f"w{i}" for i in range(84))
        body = {"prompt": prompt, "n_predict": 24, "n_probs": 1, "return_tokens": True}
        kept = greedy(s, u, "/completion", body, ("tokens", "tokens_evaluated"))
        assert kept["tokens_evaluated"] + 24 > 256, kept["tokens_evaluated"]
        none = greedy(s, u, "/completion", {**body, "n_keep": 0}, ("tokens",))
        # the tiny model's greedy tokens do not notice, its probabilities after the shift do
        last = [r["completion_probabilities"][-1]["top_logprobs"][0]["logprob"] for r in (kept, none)]
        assert abs(last[0] - last[1]) > 1e-4, last
        for server in (s, u):
            shifts = [l for l in server.log().splitlines() if "slot context shift" in l]
            assert len(shifts) == 2 and "n_keep = 5," in shifts[0] and "n_keep = 1," in shifts[1], (server.name, shifts)


def test_checkpoint_min_step_0_checkpoints_every_user_turn():
    turns = []
    for i in range(4):
        turns += [{"role": "user", "content": f"question number {i} about the weather today"},
                  {"role": "assistant", "content": f"answer {i} is sunny and warm"}]
    # -lv 4: the checkpoint lines are trace lines in both servers
    with pair("-m", model("tiny-qwen35moe-mtp.gguf"), "-c", "1024", "-np", "1", "-cms", "0", "-lv", "4") as (s, u):
        for last in ("last question", "another last one"):
            greedy(s, u, "/v1/chat/completions", {"messages": turns + [{"role": "user", "content": last}], "max_tokens": 2},
                   ("choices.0.message.content", "usage"))
        made = [[l.split("created context checkpoint ", 1)[1] for l in server.log().splitlines() if "created context checkpoint" in l]
                for server in (s, u)]
        assert made[0] == made[1], made
        # the default spacing (8192 tokens) leaves out the user turn at 75 tokens, 25 past the last one
        assert any("n_tokens = 75," in m for m in made[0]), made[0]


# --- agent and tools -------------------------------------------------------------------------

def test_agent_enables_the_tools_the_proxy_and_localhost_cors():
    with pair("-m", model("tiny-llama.gguf"), "-c", "256", "-np", "1", "-ag") as (s, u):
        tools = both(s, u, "GET", "/tools")[1]
        assert [t["tool"] for t in tools] == ["read_file", "file_glob_search", "grep_search", "exec_shell_command",
                                              "write_file", "edit_file", "get_info"], tools
        status = both(s, u, "GET", "/cors-proxy")[0]
        assert status not in (403, 404), status
        cors = ("Access-Control-Allow-Origin", "Access-Control-Allow-Credentials", "Access-Control-Allow-Methods",
                "Access-Control-Allow-Headers")
        for origin, allowed in (("http://evil.com", None), ("http://localhost:3000", "http://localhost:3000")):
            a = s.request("OPTIONS", "/completion", headers={"Origin": origin})
            b = u.request("OPTIONS", "/completion", headers={"Origin": origin})
            got = {h: a[2].get(h) for h in cors}
            assert got == {h: b[2].get(h) for h in cors}, (origin, got, dict(b[2]))
            assert got["Access-Control-Allow-Origin"] == allowed, got


def test_tools_runtime_runs_the_tools_in_the_named_container_or_refuses_a_bad_target():
    bad = start_fails("-m", model("tiny-llama.gguf"), "--tools", "all", "--tools-runtime", "ssh:-oProxyCommand=x")
    for status, err in bad:
        assert status == 1 and "invalid ssh target: -oProxyCommand=x" in err, (status, err[-2000:])
    # the attach form is checked when a tool runs: the command goes to `docker exec`, never the host
    with pair("-m", model("tiny-llama.gguf"), "-c", "256", "-np", "1", "--tools", "all",
              "--tools-runtime", "docker-container:abc123") as (s, u):
        answer = both(s, u, "POST", "/tools", {"tool": "exec_shell_command", "params": {"command": "echo hi-from-host"}})[1]
        assert "hi-from-host" not in json.dumps(answer), answer


# --- speculative decoding --------------------------------------------------------------------
# The drafters' settings show twice: in llama.cpp's own start-up trace of common_speculative
# (the same code in both servers, so the same lines), and in what they draft. A grammar makes the
# tiny model repeat one sentence, which the n-gram drafters can then look up.

REPEAT = {"prompt": " ".join(["the cat sat on the mat."] * 6), "n_predict": 64, "return_tokens": True, "ignore_eos": True,
          "grammar": 'root ::= (" the cat sat on the mat.")+'}
PLAIN = {"prompt": "hello world", "n_predict": 32, "return_tokens": True}
DRAFTED = ("tokens", "timings.draft_n", "timings.draft_n_accepted")


def spec_trace(server: Server) -> list[str]:
    """common_speculative's start-up lines (-lv 4), without timestamps and end-of-run statistics."""
    lines = [l.split("common_specu: ", 1)[1] for l in server.log().splitlines() if "common_specu: " in l]
    return [l for l in lines if not l.startswith("statistics")]


def speculative(model_name: str, flags: list[str], body: dict, trace: list[str]) -> dict:
    """One greedy request to both servers started with flags; the tokens, draft counters and the
    drafter's start-up trace must agree, and the trace must hold each line of trace."""
    with pair("-m", model(model_name), "-c", "512", "-np", "1", "-lv", "4", *flags) as (s, u):
        answer = greedy(s, u, "/completion", body, DRAFTED)
        got = spec_trace(s)
        assert got == spec_trace(u), (got, spec_trace(u))
        for line in trace:
            assert line in got, (line, got)
        return answer["timings"]


def test_ngram_simple_size_and_min_hits():
    # the default size 12 drafts 36 tokens here; min_hits is printed but not read by the
    # ngram-simple drafter, in both servers
    t = speculative("tiny-llama.gguf", ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3",
                                        "--spec-ngram-simple-min-hits", "5"], REPEAT, ["- size_n=3, size_m=48, min_hits=5"])
    assert t.get("draft_n") not in (None, 36), t


def test_ngram_map_k_size_and_min_hits():
    # with the default key of 12 tokens this history gives no draft; min_hits is printed but not
    # read by the key-only drafter, in both servers
    t = speculative("tiny-llama.gguf", ["--spec-type", "ngram-map-k", "--spec-ngram-map-k-size-n", "2",
                                        "--spec-ngram-map-k-min-hits", "3"], REPEAT,
                    ["- size_key=2, size_value=48, key_only=1, min_hits=3"])
    assert t["draft_n"] > 0


def test_ngram_map_k4v_size_and_min_hits():
    # a 2-token key drafts here with one hit; three hits are never reached, so nothing is drafted
    # (the default 12-token key drafts nothing either: its size shows in the trace)
    t = speculative("tiny-llama.gguf", ["--spec-type", "ngram-map-k4v", "--spec-ngram-map-k4v-size-n", "2",
                                        "--spec-ngram-map-k4v-min-hits", "3"], REPEAT,
                    ["- size_key=2, size_value=48, key_only=0, min_hits=3"])
    assert "draft_n" not in t, t


def test_ngram_mod_match_and_min():
    # upstream drafts 95 tokens here; 82 without the minimum (48), 87 without the match (24), 79 with neither
    t = speculative("tiny-llama.gguf", ["--spec-type", "ngram-mod", "--spec-ngram-mod-n-match", "12",
                                        "--spec-ngram-mod-n-min", "4"], REPEAT, ["- n_match=12, n_max=64, n_min=4"])
    assert t["draft_n"] not in (79, 82, 87), t


def test_spec_default_is_ngram_mod_with_its_sizes():
    t = speculative("tiny-llama.gguf", ["--spec-default"], REPEAT,
                    ["adding speculative implementation 'ngram-mod'", "- n_match=24, n_max=64, n_min=48"])
    assert t["draft_n"] > 0


@pytest.mark.parametrize("flags, trace", [
    (["--spec-draft-n-min", "4"], "- n_max=3, n_min=4, p_min=0.000000"),
    (["--spec-draft-p-min", "0.99"], "- n_max=3, n_min=0, p_min=0.990000"),
    (["--draft-p-min", "0.99"], "- n_max=3, n_min=0, p_min=0.990000"),
], ids=["n-min", "p-min", "p-min-alias"])
def test_draft_model_n_min_and_p_min_drop_drafts(flags, trace):
    # the model as its own draft drafts 3 tokens a step (23 in this answer) with the defaults:
    # a minimum of 4 drops every draft, and so does p 0.99 on a tiny model that is never that sure
    t = speculative("tiny-llama.gguf", ["-md", model("tiny-llama.gguf"), "--spec-type", "draft-simple", *flags], PLAIN, [trace])
    assert "draft_n" not in t, t


def test_mtp_synthetic_acceptance_and_draft_backend_sampling():
    trace = ["- n_max=3, n_min=0, p_min=0.00, n_embd=64, backend_sampling=0",
             "synthetic acceptance: n_max = 3, mean length = 2.500000, rates = [0.691414, 0.478053, 0.330533]"]
    with pair("-m", model("tiny-qwen35moe-mtp.gguf"), "-c", "512", "-np", "1", "-lv", "4", "--spec-type", "draft-mtp",
              "--spec-synth-len", "2.5", "--no-spec-draft-backend-sampling") as (s, u):
        assert spec_trace(s) == spec_trace(u), (spec_trace(s), spec_trace(u))
        for line in trace:
            assert line in spec_trace(s), (line, spec_trace(s))
        # synthetic acceptance draws at random (upstream's answers differ run to run), and the
        # tiny model's MTP head is never right (0 of 87 drafted tokens without --spec-synth-len)
        for server in (s, u):
            t = server.post("/completion", {**PLAIN, "temperature": 0})["timings"]
            assert t["draft_n_accepted"] > 0, (server.name, t)


def write_ngram_cache(path: Path, tokens: list[int], n: int):
    """A lookup cache in common_ngram_cache_save's format mapping each n-gram of tokens to the
    token after it: 4 token ids (unused ones -1), a count of entries, then (token, count) pairs."""
    entries = {}
    for i in range(len(tokens) - n):
        entries.setdefault(tuple(tokens[i:i + n]), tokens[i + n])
    with open(path, "wb") as f:
        for key, nxt in entries.items():
            f.write(struct.pack("<4i", *key, *[-1] * (4 - n)) + struct.pack("<iii", 1, nxt, 10))


def test_lookup_caches_static_and_dynamic(tmp_path):
    no_file = str(tmp_path / "missing.bin")
    for flag, message in (("-lcs", "Couldn't read static lookup cache"), ("-lcd", "Couldn't read dynamic lookup cache")):
        for status, err in start_fails("-m", model("tiny-llama.gguf"), "-c", "256", "--spec-type", "ngram-cache", flag, no_file,
                                       env={"GGML_NO_BACKTRACE": "1"}):
            assert status == -6 and message in err, (flag, status, err[-2000:])
    # the tiny model's answer never repeats, so the context alone drafts nothing
    with pair("-m", model("tiny-llama.gguf"), "-c", "512", "-np", "1", "--spec-type", "ngram-cache") as (s, u):
        plain = greedy(s, u, "/completion", PLAIN, DRAFTED)
        assert "draft_n" not in plain["timings"], plain["timings"]
        prompt = both(s, u, "POST", "/tokenize", {"content": PLAIN["prompt"], "add_special": True})[1]["tokens"]
    history = prompt + plain["tokens"]
    # a static cache is looked up by the last 2 tokens; a dynamic one by the last 1 to 4
    write_ngram_cache(tmp_path / "static.bin", history, 2)
    write_ngram_cache(tmp_path / "dynamic.bin", history, 1)
    for flag, name in (("-lcs", "static.bin"), ("-lcd", "dynamic.bin")):
        with pair("-m", model("tiny-llama.gguf"), "-c", "512", "-np", "1", "--spec-type", "ngram-cache",
                  flag, str(tmp_path / name)) as (s, u):
            cached = greedy(s, u, "/completion", PLAIN, DRAFTED)
            assert cached["tokens"] == plain["tokens"], flag
            assert cached["timings"]["draft_n_accepted"] > 0, (flag, cached["timings"])


# --- downloads, from a local stand-in for Hugging Face -----------------------------------------

COMMIT = "0123456789abcdef0123456789abcdef01234567"
TOKEN = "hf_" + "a1" * 20


class Hub(http.server.ThreadingHTTPServer):
    """The Hugging Face API calls llama.cpp's downloader makes (refs, tree, resolve), and plain
    files for --model-url; every request is recorded as (method, path, Authorization)."""

    def __init__(self, repos: dict[str, dict[str, str]], token: str | None = None):
        super().__init__(("127.0.0.1", 0), HubHandler)
        self.repos, self.token, self.requests = repos, token, []
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        threading.Thread(target=self.serve_forever, daemon=True).start()

    def paths(self) -> list[str]:
        return [p for _, p, _ in self.requests]


class HubHandler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def answer(self, status: int, body: bytes, kind: str = "application/json", head: bool = False):
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("ETag", f'"{len(body)}"')
        self.send_header("Accept-Ranges", "none")
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def do_HEAD(self):
        self.do_GET(head=True)

    def do_GET(self, head: bool = False):
        hub = self.server
        path = self.path.split("?", 1)[0]
        auth = self.headers.get("Authorization")
        hub.requests.append((self.command, path, auth))
        if hub.token and auth != f"Bearer {hub.token}":
            return self.answer(401, json.dumps({"error": "Invalid credentials in Authorization header"}).encode(), head=head)
        parts = path.strip("/").split("/")
        if parts[0] == "files" and len(parts) == 2:
            return self.answer(200, Path(model(parts[1])).read_bytes(), "application/octet-stream", head)
        if parts[:2] == ["api", "models"]:
            repo, rest = "/".join(parts[2:4]), parts[4:]
            if repo in hub.repos and rest == ["refs"]:
                return self.answer(200, json.dumps({"branches": [{"name": "main", "targetCommit": COMMIT}]}).encode(), head=head)
            if repo in hub.repos and rest == ["tree", COMMIT]:
                tree = [{"type": "file", "path": f, "size": 1} for f in hub.repos[repo]]
                return self.answer(200, json.dumps(tree).encode(), head=head)
        elif len(parts) >= 5 and parts[2:4] == ["resolve", COMMIT]:
            files = hub.repos.get("/".join(parts[:2]), {})
            name = "/".join(parts[4:])
            if name in files:
                return self.answer(200, Path(model(files[name])).read_bytes(), "application/octet-stream", head)
        self.answer(404, json.dumps({"error": "Repository not found"}).encode(), head=head)


@contextlib.contextmanager
def hub(repos: dict[str, dict[str, str]], token: str | None = None):
    h = Hub(repos, token)
    try:
        yield h
    finally:
        h.shutdown()
        h.server_close()


def caches(tmp_path: Path) -> tuple[dict, dict]:
    """Each server's own empty LLAMA_CACHE, so that each downloads for itself."""
    envs = []
    for name in ("strata", "upstream"):
        (tmp_path / name).mkdir(exist_ok=True)
        envs.append({"LLAMA_CACHE": str(tmp_path / name)})
    return envs[0], envs[1]


REPO_FILES = {"test/tiny-GGUF": {"tiny-Q8_0.gguf": "tiny-llama.gguf", "fim-Q4_K_M.gguf": "tiny-llama-fim.gguf"}}


def test_hf_repo_file_token_and_offline(tmp_path):
    flags = ("-hf", "test/tiny-GGUF", "-hff", "tiny-Q8_0.gguf", "-c", "256", "-np", "1")
    s_env, u_env = caches(tmp_path)
    with hub(REPO_FILES, token=TOKEN) as h:
        for e in (s_env, u_env):
            e["MODEL_ENDPOINT"] = h.url
        # --offline with nothing cached: no file is found, the same failure, and not one request
        fails = start_fails(*flags, "--offline", "-hft", TOKEN, env=s_env, upstream_env=u_env)
        for status, err in fails:
            assert status == 1 and "exactly one out metadata, path_model, and file must be defined" in err, (status, err[-2000:])
        assert h.requests == [], h.requests
        # -hft is the bearer token of every request; -hff picks the file, where the default
        # choice would be the Q4_K_M one
        with pair(*flags, "-hft", TOKEN, env=s_env, upstream_env=u_env) as (s, u):
            props = [server.get("/props")[1] for server in (s, u)]
            assert [Path(p["model_path"]).name for p in props] == ["tiny-Q8_0.gguf"] * 2, props
            assert props[0]["bos_token"] == props[1]["bos_token"] == "<s>"
            greedy(s, u, "/completion", PLAIN, ("tokens",))
        assert h.requests and all(auth == f"Bearer {TOKEN}" for _, _, auth in h.requests), h.requests
        assert h.paths().count(f"/test/tiny-GGUF/resolve/{COMMIT}/tiny-Q8_0.gguf") >= 2, h.paths()
        assert not any("fim-Q4_K_M" in p for p in h.paths()), h.paths()
        # --offline with the files cached: both start from the cache and ask the hub nothing
        h.requests.clear()
        with pair(*flags, "--offline", env=s_env, upstream_env=u_env) as (s, u):
            greedy(s, u, "/completion", PLAIN, ("tokens",))
        assert h.requests == [], h.requests


def test_hf_repo_draft_is_downloaded_and_drafts(tmp_path):
    s_env, u_env = caches(tmp_path)
    with hub({**REPO_FILES, "test/draft-GGUF": {"draft-Q8_0.gguf": "tiny-llama.gguf"}}) as h:
        for e in (s_env, u_env):
            e["MODEL_ENDPOINT"] = h.url
        with pair("-hf", "test/tiny-GGUF", "-hff", "tiny-Q8_0.gguf", "-hfd", "test/draft-GGUF", "--spec-type", "draft-simple",
                  "-c", "256", "-np", "1", env=s_env, upstream_env=u_env) as (s, u):
            drafted = greedy(s, u, "/completion", PLAIN, DRAFTED)
            assert drafted["timings"]["draft_n_accepted"] > 0, drafted["timings"]
            for server, cache in ((s, s_env), (u, u_env)):
                line = next((l for l in server.log().splitlines() if "loading draft model" in l), "")
                assert line.endswith(f"/draft-Q8_0.gguf'") and cache["LLAMA_CACHE"] in line, (server.name, line)
        assert h.paths().count(f"/test/draft-GGUF/resolve/{COMMIT}/draft-Q8_0.gguf") >= 2, h.paths()


def test_model_url_downloads_to_the_model_path(tmp_path):
    paths = [tmp_path / "strata.gguf", tmp_path / "upstream.gguf"]
    with hub({}) as h:
        url = f"{h.url}/files/tiny-llama.gguf"
        with pair("-m", str(paths[0]), "-mu", url, "-c", "256", "-np", "1",
                  upstream_args=["-m", str(paths[1]), "-mu", url, "-c", "256", "-np", "1"]) as (s, u):
            greedy(s, u, "/completion", PLAIN, ("tokens",))
            for server, path in zip((s, u), paths):
                assert server.get("/props")[1]["model_path"] == str(path)
        for path in paths:
            assert path.read_bytes() == Path(model("tiny-llama.gguf")).read_bytes()
        assert h.paths().count("/files/tiny-llama.gguf") >= 2, h.paths()


def test_docker_repo_fails_as_upstream_does(tmp_path):
    # Docker Hub's registry and token service are fixed https URLs, so no stand-in can answer: the
    # evidence is the same failure, offline or (for a repository that does not exist) online
    failed = []
    for status, err in start_fails("-dr", "strata-test/no-such-model", env={"LLAMA_CACHE": str(tmp_path)}):
        assert status == 1, (status, err[-2000:])
        assert "Downloading Docker Model: strata-test/no-such-model:latest" in err, err[-2000:]
        failed.append(next((l.split("failed to download model: ", 1)[1] for l in err.splitlines() if "failed to download model: " in l), err))
    assert failed[0] == failed[1], failed


# --- presets: the repositories they name, served by the stand-in hub --------------------------

FIM_DRAFT = {"ggml-org/Qwen2.5-Coder-0.5B-Q8_0-GGUF": {"qwen2.5-coder-0.5b-q8_0.gguf": "tiny-llama-fim.gguf"}}
PRESETS = {
    "--embd-gemma-default": ({"ggml-org/embeddinggemma-300M-qat-q4_0-GGUF": {"embeddinggemma-300M-qat-Q4_0.gguf": "tiny-bert-embd.gguf"}},
                             2048, 2048, 32),
    "--fim-qwen-1.5b-default": ({"ggml-org/Qwen2.5-Coder-1.5B-Q8_0-GGUF": {"qwen2.5-coder-1.5b-q8_0.gguf": "tiny-llama-fim.gguf"}},
                                1024, 1024, None),
    "--fim-qwen-3b-default": ({"ggml-org/Qwen2.5-Coder-3B-Q8_0-GGUF": {"qwen2.5-coder-3b-q8_0.gguf": "tiny-llama-fim.gguf"}},
                              1024, 1024, None),
    "--fim-qwen-7b-default": ({"ggml-org/Qwen2.5-Coder-7B-Q8_0-GGUF": {"qwen2.5-coder-7b-q8_0.gguf": "tiny-llama-fim.gguf"}},
                              1024, 1024, None),
    "--fim-qwen-7b-spec": ({"ggml-org/Qwen2.5-Coder-7B-Q8_0-GGUF": {"qwen2.5-coder-7b-q8_0.gguf": "tiny-llama-fim.gguf"}, **FIM_DRAFT},
                           1024, 1024, None),
    "--fim-qwen-14b-spec": ({"ggml-org/Qwen2.5-Coder-14B-Q8_0-GGUF": {"qwen2.5-coder-14b-q8_0.gguf": "tiny-llama-fim.gguf"}, **FIM_DRAFT},
                            1024, 1024, None),
    "--fim-qwen-30b-default": ({"ggml-org/Qwen3-Coder-30B-A3B-Instruct-Q8_0-GGUF":
                                {"qwen3-coder-30b-a3b-instruct-q8_0.gguf": "tiny-llama-fim.gguf"}}, 1024, 1024, None),
}


def context_lines(server: Server) -> list[str]:
    """llama.cpp's report of each context it creates (-lv 4): sequences, size, batch sizes."""
    keys = ("llama_context: n_seq_max", "llama_context: n_ctx ", "llama_context: n_batch", "llama_context: n_ubatch")
    return [l.split(" I ", 1)[-1] for l in server.log().splitlines() if any(k in l for k in keys)]


@pytest.mark.parametrize("preset", PRESETS)
def test_preset_downloads_its_model_and_sets_its_parameters(tmp_path, preset):
    repos, n_batch, n_ubatch, n_parallel = PRESETS[preset]
    s_env, u_env = caches(tmp_path)
    with hub(repos) as h:
        for e in (s_env, u_env):
            e["MODEL_ENDPOINT"] = h.url
        with pair(preset, "-lv", "4", env=s_env, upstream_env=u_env) as (s, u):
            props = same_props(s, u, "total_slots", "bos_token", "default_generation_settings.n_ctx")
            main = next(iter(repos.values()))
            assert Path(props["model_path"]).name == next(iter(main)), props["model_path"]
            lines = context_lines(s)
            assert lines == context_lines(u), (lines, context_lines(u))
            assert f"llama_context: n_batch               = {n_batch}" in lines, lines
            assert f"llama_context: n_ubatch              = {n_ubatch}" in lines, lines
            if n_parallel:
                assert props["total_slots"] == n_parallel, props["total_slots"]
            if preset == "--embd-gemma-default":
                # the preset turns on embeddings: /v1/embeddings answers without --embeddings
                a, b = s.post("/v1/embeddings", {"input": "hello"}), u.post("/v1/embeddings", {"input": "hello"})
                assert a["data"][0]["embedding"] == pytest.approx(b["data"][0]["embedding"], rel=1e-4, abs=1e-5)
            else:
                greedy(s, u, "/infill", {"input_prefix": "def f(", "input_suffix": "):\n", "n_predict": 4, "return_tokens": True},
                       ("tokens", "prompt", "timings.draft_n"))
                drafts = [[l for l in server.log().splitlines() if "loading draft model" in l] for server in (s, u)]
                assert len(drafts[0]) == len(drafts[1]) == (1 if preset.endswith("-spec") else 0), drafts
        for repo, files in repos.items():
            for f in files:
                assert h.paths().count(f"/{repo}/resolve/{COMMIT}/{f}") >= 2, (f, h.paths())


def test_a_slot_context_past_the_training_context_is_capped():
    with pair("-m", model("tiny-llama.gguf"), "-c", "8192", "-np", "1") as (s, u):
        assert same_props(s, u, "default_generation_settings.n_ctx")["default_generation_settings"]["n_ctx"] == 4096


# --- -bs: sampling in the context's graph ----------------------------------------------------

def test_backend_sampling_answers_as_upstream_over_both_slots():
    """-bs: seeded sampling, post-sampling probabilities, a grammar (sampled on the CPU) and
    pre-sampling probabilities (the CPU chain's) give upstream's answers, on both slots, with
    requests that attach and detach each slot's sampler in turn."""
    with pair("-m", model("tiny-llama.gguf"), "-c", "512", "-np", "2", "-bs", "--seed", "42") as (s, u):
        assert ("setting backend sampler" in s.log()) == ("setting backend sampler" in u.log())
        prompt = "The countries of Europe, in random order, are:"
        bodies = [
            {"prompt": prompt, "n_predict": 12, "seed": 4242, "temperature": 1.2},
            {"prompt": prompt, "n_predict": 8, "seed": 7, "top_k": 3, "n_probs": 5, "post_sampling_probs": True},
            {"prompt": prompt, "n_predict": 8, "seed": 7, "n_probs": 5, "backend_sampling": True},
            {"prompt": prompt, "n_predict": 6, "seed": 9, "grammar": 'root ::= [a-z ]+'},
            {"prompt": prompt, "n_predict": 12, "seed": 4242, "temperature": 1.2, "backend_sampling": False},
        ]
        for slot in (0, 1):
            for b in bodies:
                a, c = (x.post("/completion", {**b, "id_slot": slot, "cache_prompt": False}) for x in (s, u))
                assert a["content"] == c["content"], (b, a["content"], c["content"])
                pa, pc = (r.get("completion_probabilities", []) for r in (a, c))
                assert [t["id"] for t in pa] == [t["id"] for t in pc]
                for ta, tc in zip(pa, pc):
                    key = "top_probs" if b.get("post_sampling_probs") else "top_logprobs"
                    assert [t["id"] for t in ta[key]] == [t["id"] for t in tc[key]], b
        assert s.post("/completion", bodies[0])["content"] == s.post("/completion", bodies[4])["content"], \
            "the graph and the CPU chain draw the same tokens"
