"""Server flags and answers, differential: the same flags and requests to strata-server and to the
pinned upstream llama-server (tools/build-upstream), on real GGUF models over loopback HTTP, one
section per flag or answer."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import struct
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import servers

httpx = pytest.importorskip("httpx")
anthropic = pytest.importorskip("anthropic")

REPO = Path(__file__).resolve().parents[2]
STRATA = Path(os.environ.get("STRATA_SERVER", REPO / "target" / "release" / "strata-server"))
UPSTREAM = Path(os.environ.get("STRATA_UPSTREAM_SERVER", REPO / "target" / "upstream" / "bin" / "llama-server"))
MODELS = REPO / ".cache" / "models"
GEMMA = MODELS / "gemma3-270m-q4_k_m.gguf"
TINY = MODELS / "tiny-llama.gguf"
FIM = MODELS / "tiny-llama-fim.gguf"
BERT = MODELS / "tiny-bert-embd.gguf"
QWEN = MODELS / "tiny-qwen3moe.gguf"


def need(*paths: Path) -> None:
    for p in (STRATA, UPSTREAM, *paths):
        if not p.exists():
            pytest.skip(f"{p} is not built (run tools/setup and tools/build-upstream)")


@contextlib.contextmanager
def started(binary: Path, args: list[str], log: Path | None = None):
    stderr = open(log, "w") if log else subprocess.DEVNULL
    proc, url = servers.start(binary, ["--host", "127.0.0.1", *args], stderr=stderr)
    try:
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        if log:
            stderr.close()


@contextlib.contextmanager
def both(args: list[str], tmp_path: Path | None = None):
    """{"strata": url, "upstream": url}, the two servers started with the same flags (and their
    logs under tmp_path when given)."""
    log = (lambda name: tmp_path / f"{name}.log") if tmp_path else (lambda name: None)
    with started(STRATA, args, log("strata")) as s, started(UPSTREAM, args, log("upstream")) as u:
        yield {"strata": s, "upstream": u}


def post(url: str, path: str, body) -> tuple[int, dict]:
    r = httpx.post(url + path, json=body, timeout=300)
    return r.status_code, r.json()


def stream_events(url: str, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", url + path, json=body, timeout=300) as r:
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]


# ---- -r / --reverse-prompt ---------------------------------------------------------------------


def test_reverse_prompts_are_the_default_stop_strings(tmp_path):
    need(GEMMA)
    prompt = {"prompt": "Once upon a time", "n_predict": 24, "temperature": 0}
    answers = {}
    with both(["-m", str(GEMMA), "-c", "1024", "-np", "1", "-r", " town", "--reverse-prompt", "zzzz"]) as urls:
        for name, url in urls.items():
            answers[name] = [
                post(url, "/completion", prompt)[1],
                # empty stop strings are none of its own: the server's stay
                post(url, "/completion", {**prompt, "stop": [None, []]})[1],
                post(url, "/completion", {**prompt, "stop": ["never-said"]})[1],
                post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Tell a story about a town."}],
                                                   "max_tokens": 24, "temperature": 0})[1],
                httpx.get(url + "/props").json()["default_generation_settings"],
            ]
    s, u = answers["strata"], answers["upstream"]
    for a in s[:3]:
        assert a["stop"] and a["generation_settings"]["stop"], a
    assert s[0]["stop_type"] == "word" and s[0]["stopping_word"] == " town", s[0]
    assert s[0]["generation_settings"]["stop"] == [" town", "zzzz"]
    assert s[2]["generation_settings"]["stop"] == ["never-said"] and " town" in s[2]["content"]
    for a, b in zip(s[:3], u[:3]):
        assert (a["content"], a["stop_type"], a["stopping_word"], a["generation_settings"]["stop"]) == \
            (b["content"], b["stop_type"], b["stopping_word"], b["generation_settings"]["stop"])
    assert s[3]["choices"][0]["message"]["content"] == u[3]["choices"][0]["message"]["content"]
    assert s[3]["choices"][0]["finish_reason"] == u[3]["choices"][0]["finish_reason"]
    # /props shows the metrics form of the settings, which has no stop strings, upstream too
    assert "stop" not in s[4]["params"] and s[4]["params"].keys() == u[4]["params"].keys()


# ---- -sp / --special, and a task's preserved tokens ---------------------------------------------


def special_answers(url: str) -> list[dict]:
    ids = [t["id"] for t in post(url, "/tokenize", {"content": "<start_of_turn><end_of_turn>", "with_pieces": True})[1]["tokens"]]
    start, end = ids
    base = {"prompt": "Hello", "n_predict": 3, "temperature": 0, "n_probs": 2}
    out = []
    for body in (
        {**base, "logit_bias": [[start, 100]]},
        {**base, "logit_bias": [[start, 100]], "post_sampling_probs": True},
        {**base, "logit_bias": [[start, 100]], "preserved_tokens": ["<start_of_turn>"]},
        {**base, "logit_bias": [[end, 100]]},
    ):
        status, a = post(url, "/completion", body)
        assert status == 200, a
        probs = [(p["id"], p["token"], [(t["id"], t["token"]) for t in p.get("top_logprobs", p.get("top_probs", []))])
                 for p in a["completion_probabilities"]]
        out.append({"content": a["content"], "stop_type": a["stop_type"], "probs": probs})
    chunks = stream_events(url, "/completion", {**base, "logit_bias": [[start, 100]], "stream": True})
    out.append({"streamed": "".join(c["content"] for c in chunks)})
    return out


@pytest.mark.parametrize("special", [False, True])
def test_special_tokens_and_preserved_tokens_render_as_upstream(special):
    need(GEMMA)
    flags = ["-sp"] if special else []
    with both(["-m", str(GEMMA), "-c", "512", "-np", "1", *flags]) as urls:
        s, u = special_answers(urls["strata"]), special_answers(urls["upstream"])
    assert s == u
    forced, post_sampling, preserved, eog, streamed = s
    # a control token is text only with -sp, or when the task preserves it
    assert forced["content"] == ("<start_of_turn>" * 3 if special else "")
    assert streamed["streamed"] == forced["content"]
    assert preserved["content"] == "<start_of_turn>" * 3
    assert eog["content"] == ("<end_of_turn>" if special else "") and eog["stop_type"] == "eos"
    top = post_sampling["probs"][0][2][0]
    assert top[0] == post_sampling["probs"][0][0] and top[1] == ("<start_of_turn>" if special else "")


# ---- -nocb / --no-cont-batching -----------------------------------------------------------------


def finishing_order(url: str, log: Path) -> list[str]:
    """Which of a long generation (A) and a one-token request sent while A generates (B) the
    server finishes first, from the order of its print_timings lines."""
    first = threading.Event()
    done = threading.Event()

    def long_one():
        body = {"prompt": "a", "n_predict": 400, "ignore_eos": True, "temperature": 0, "stream": True}
        with httpx.stream("POST", url + "/completion", json=body, timeout=300) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    first.set()
        done.set()

    t = threading.Thread(target=long_one)
    t.start()
    assert first.wait(120)
    status, b = post(url, "/completion", {"prompt": "b", "n_predict": 1, "temperature": 0})
    assert status == 200, b
    t.join()
    # llama.cpp's logger writes from a thread of its own: wait for both lines
    deadline = time.monotonic() + 60
    while True:
        order = []
        for line in log.read_text().splitlines():
            m = re.search(r" eval time = .* / +(\d+) tokens", line)
            if m and "prompt eval" not in line:
                order.append("A" if int(m.group(1)) > 100 else "B")
        if len(order) == 2 or time.monotonic() > deadline:
            return order
        time.sleep(0.1)


@pytest.mark.parametrize("cont_batching", [True, False])
def test_no_cont_batching_keeps_prompts_out_of_generating_batches(tmp_path, cont_batching):
    need(TINY)
    flags = [] if cont_batching else ["-nocb"]
    with both(["-m", str(TINY), "-c", "1024", "-np", "2", *flags], tmp_path) as urls:
        orders = {name: finishing_order(url, tmp_path / f"{name}.log") for name, url in urls.items()}
    assert orders["strata"] == orders["upstream"]
    # with -nocb the second prompt waits until nothing generates; otherwise it joins at once
    assert orders["strata"] == (["B", "A"] if cont_batching else ["A", "B"])


# ---- --cache-prompt / --no-cache-prompt ---------------------------------------------------------


@pytest.mark.parametrize("flag", ["--cache-prompt", "--no-cache-prompt"])
def test_cache_prompt_default_comes_from_the_server(flag):
    need(TINY)
    body = {"prompt": "The quick brown fox jumps over the lazy dog " * 4, "n_predict": 4, "temperature": 0}
    seen = {}
    with both(["-m", str(TINY), "-c", "1024", "-np", "1", flag]) as urls:
        for name, url in urls.items():
            bodies = (body, body, {**body, "cache_prompt": True}, {**body, "cache_prompt": False})
            runs = [post(url, "/completion", b)[1]["timings"] for b in bodies]
            seen[name] = [(t["cache_n"], t["prompt_n"]) for t in runs]
    assert seen["strata"] == seen["upstream"]
    (_, n), second, asked, refused = seen["strata"]
    assert second == ((n - 1, 1) if flag == "--cache-prompt" else (0, n))
    assert asked == (n - 1, 1) and refused == (0, n), "a request's own cache_prompt wins"


# ---- --kv-unified-per-slot, and the cap at the training context ---------------------------------

CAP_LINES = re.compile(r"(capping per-slot context.*|--kv-unified-per-slot \(\d+\) exceeds.*"
                       r"|the slot context \(\d+\) exceeds.*)$")


@pytest.mark.parametrize("args, n_ctx", [
    (["--kv-unified-per-slot", "256"], 256),
    (["-c", "512", "-np", "2", "--kv-unified-per-slot", "1024"], 256),
    (["-c", "8192", "-np", "1"], 4096),
])
def test_slot_context_caps_as_upstream(tmp_path, args, n_ctx):
    need(TINY)
    with both(["-m", str(TINY), *args], tmp_path) as urls:
        props = {name: httpx.get(url + "/props").json()["default_generation_settings"]["n_ctx"] for name, url in urls.items()}
        meta = {name: httpx.get(url + "/v1/models").json()["data"][0]["meta"]["n_ctx"] for name, url in urls.items()}
        too_long = {"prompt": [1] + [450] * n_ctx, "n_predict": 1}
        errors = {name: post(url, "/completion", too_long) for name, url in urls.items()}
    assert props == meta == {"strata": n_ctx, "upstream": n_ctx}
    assert errors["strata"] == errors["upstream"] and errors["strata"][0] == 400
    lines = {name: [m.group(1) for line in (tmp_path / f"{name}.log").read_text().splitlines() if (m := CAP_LINES.search(line))]
             for name in urls}
    assert lines["strata"] == lines["upstream"] and lines["strata"], lines


# ---- --log-prompts-dir --------------------------------------------------------------------------

PROMPT_LOG_REQUESTS = [
    ("/completion", {"prompt": "Hello there", "n_predict": 2}),
    ("/completion", {"prompt": [1, 15043, 727], "n_predict": 2, "stream": True}),
    ("/completion", {"prompt": ["a", 338, "b\u0000hidden"], "n_predict": 2}),
    ("/v1/completions", {"prompt": ["first", "séconde"], "max_tokens": 2}),
    # refused by the schema after the prompt is written, as upstream does
    ("/completion", {"prompt": "x", "n_predict": "many"}),
    # no prompt: nothing is written
    ("/completion", {"n_predict": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}),
    ("/v1/messages", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}),
    ("/v1/responses", {"input": "Hi", "max_output_tokens": 2}),
    ("/infill", {"input_prefix": "def f(", "input_suffix": "):\n", "prompt": "x", "n_predict": 2}),
    ("/tokenize", {"content": "not a completion"}),
    ("/apply-template", {"messages": [{"role": "user", "content": "Hi"}]}),
    ("/v1/messages/count_tokens", {"messages": [{"role": "user", "content": "Hi"}]}),
]


def logged_prompts(url: str, logdir: Path) -> list[list[str]]:
    out = []
    for path, body in PROMPT_LOG_REQUESTS:
        before = time.monotonic_ns() // 1_000_000
        httpx.post(url + path, json=body, timeout=300).read()
        after = time.monotonic_ns() // 1_000_000
        files = sorted(logdir.iterdir())
        for f in files:
            # ggml's clock, CLOCK_MONOTONIC on Linux as Python's monotonic, in 12 digits
            assert re.fullmatch(r"\d{12}\.txt", f.name), f.name
            assert before <= int(f.stem) <= after, (f.name, before, after)
        out.append([f.read_text() for f in files])
        for f in files:
            f.unlink()
    return out


def test_log_prompts_dir_writes_each_routes_prompt_as_upstream(tmp_path):
    need(FIM)
    logged = {}
    for name, binary in (("strata", STRATA), ("upstream", UPSTREAM)):
        logdir = tmp_path / name / "prompts"
        with started(binary, ["-m", str(FIM), "-c", "1024", "-np", "1", "--log-prompts-dir", str(logdir)]) as url:
            assert logdir.is_dir(), "the parser creates it"
            logged[name] = logged_prompts(url, logdir)
    assert logged["strata"] == logged["upstream"]
    s = logged["strata"]
    assert s[0] == ["Hello there"] and s[1] == ["[\n  1,\n  15043,\n  727\n]"]
    assert s[2] == ['[\n  "a",\n  338,\n  "b\\u0000hidden"\n]'] and s[3] == ['[\n  "first",\n  "séconde"\n]']
    assert s[4] == ["x"] and s[5] == []
    assert all(len(files) == 1 and "Hi" in files[0] for files in s[6:9])
    assert s[9][0].startswith("[\n  ") and s[10:] == [[], [], []]


# ---- --ui-config / --ui-config-file ------------------------------------------------------------


def start_and_exit(binary: Path, args: list[str]) -> tuple[int, str]:
    r = subprocess.run([str(binary), "--host", "127.0.0.1", "--port", str(servers.free_port()), *args],
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=300)
    return r.returncode, r.stderr


@pytest.mark.parametrize("how", ["--ui-config", "--ui-config-file"])
def test_invalid_ui_config_stops_the_server_as_upstream(tmp_path, how):
    need(TINY)
    value = "{theme: dark"
    if how == "--ui-config-file":
        (tmp_path / "ui.json").write_text(value)
        value = str(tmp_path / "ui.json")
    results = {name: start_and_exit(binary, ["-m", str(TINY), "-c", "256", how, value])
               for name, binary in (("strata", STRATA), ("upstream", UPSTREAM))}
    why = {}
    for name, (status, stderr) in results.items():
        assert status == 1, (name, stderr)
        m = re.search(r"srv          init: init: failed to parse UI config: (.*)", stderr)
        assert m, (name, stderr)
        why[name] = m.group(1)
        assert "exiting due to model loading error" in stderr
    assert why["strata"] == why["upstream"]


def test_valid_ui_config_reaches_props():
    need(TINY)
    with both(["-m", str(TINY), "-c", "256", "--ui-config", '{"theme": "dark", "n": [1, 2]}']) as urls:
        settings = {name: httpx.get(url + "/props").json()["ui_settings"] for name, url in urls.items()}
    assert settings["strata"] == settings["upstream"] == {"theme": "dark", "n": [1, 2]}


# ---- answers: Anthropic streamed usage, streamed /completion's prompt ----------------------------


def anthropic_usage(url: str) -> list[tuple]:
    client = anthropic.Anthropic(base_url=url, api_key="unused")
    args = dict(model="any", max_tokens=4, extra_body={"temperature": 0}, system="Be brief.",
                messages=[{"role": "user", "content": "Name a colour, then name another colour."}])
    out = []
    for stream in (False, True, False, True):
        if stream:
            with client.messages.stream(**args) as s:
                start = next(e for e in s if e.type == "message_start").message.usage
                for _ in s:
                    pass
            out.append(("stream", start.input_tokens, start.cache_read_input_tokens))
        else:
            u = client.messages.create(**args).usage
            out.append(("plain", u.input_tokens, u.cache_read_input_tokens))
    return out


def test_streamed_anthropic_message_start_counts_the_cache():
    need(QWEN)
    with both(["-m", str(QWEN), "-c", "2048", "-np", "1", "--jinja"]) as urls:
        usage = {name: anthropic_usage(url) for name, url in urls.items()}
    assert usage["strata"] == usage["upstream"]
    first, streamed = usage["strata"][0], usage["strata"][1]
    assert streamed[2] > 0 and streamed[1] + streamed[2] == first[1], usage


def test_streamed_completion_ends_with_the_prompt_text():
    need(TINY)
    body = {"prompt": "Hello <s> world", "n_predict": 3, "temperature": 0}
    got = {}
    with both(["-m", str(TINY), "-c", "256", "-np", "1"]) as urls:
        for name, url in urls.items():
            last = stream_events(url, "/completion", {**body, "stream": True})[-1]
            plain = post(url, "/completion", body)[1]
            got[name] = (last["stop"], last["prompt"], plain["prompt"])
    assert got["strata"] == got["upstream"]
    assert got["strata"][1] == got["strata"][2] != ""


# ---- embeddings ------------------------------------------------------------------------------


def decode(item: dict) -> list[float]:
    e = item["embedding"]
    if isinstance(e, str):
        raw = base64.b64decode(e)
        return list(struct.unpack(f"<{len(raw) // 4}f", raw))
    return e


TEXTS = ["hello world", "the quick brown fox jumps over the lazy dog", "a", "embeddings are vectors",
         "one two three four five six"]


def float_and_base64(url: str) -> list[bool]:
    same = []
    for inputs in (TEXTS[:2], TEXTS[1:4], TEXTS[:1], TEXTS) * 3:
        f = [decode(d) for d in post(url, "/v1/embeddings", {"input": inputs, "encoding_format": "float"})[1]["data"]]
        b = [decode(d) for d in post(url, "/v1/embeddings", {"input": inputs, "encoding_format": "base64"})[1]["data"]]
        same.append(f == b)
    return same


def test_base64_embeddings_decode_to_the_floats_as_upstream():
    need(BERT)
    with both(["-m", str(BERT), "--embeddings", "-c", "1024"]) as urls:
        same = {name: float_and_base64(url) for name, url in urls.items()}
    assert same["strata"] == same["upstream"] and all(same["strata"])


@pytest.mark.parametrize("model", [BERT, GEMMA])
def test_an_embedding_does_not_depend_on_its_batch(model):
    need(model)
    with started(STRATA, ["-m", str(model), "--embeddings", "--pooling", "mean", "-c", "2048"]) as url:
        alone = {t: decode(post(url, "/v1/embeddings", {"input": t})[1]["data"][0]) for t in TEXTS}

        def mixed(i: int) -> int:
            inputs = [TEXTS[(i * 7 + k * 3) % len(TEXTS)] for k in range(1 + i % 4)]
            data = post(url, "/v1/embeddings", {"input": inputs, "encoding_format": "base64" if i % 2 else "float"})[1]["data"]
            return sum(decode(d) != alone[t] for t, d in zip(inputs, data))

        with ThreadPoolExecutor(8) as pool:
            differing = sum(pool.map(mixed, range(48)))
    assert differing == 0
