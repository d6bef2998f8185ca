"""Several users at once: each server command in turn, N clients streaming fresh prompts at once,
then (with --mixed L) the same streams while one L-token prompt arrives among them.

  load --corpus FILE [--clients 8] [--requests 1] [--prompt-tokens 256] [--gen 256] [--mixed 32768]
       --out DIR -- LABEL CMD ARGS... --- LABEL CMD ARGS...

Each client sends its requests one after another, streaming (/completion, greedy, no prompt
cache, ignore_eos); every prompt is its own slice of the tokenized corpus, so none shares a prefix.
Per arm and case: the generated tokens a second over the whole case (first request sent to last
token), time to first token and inter-token latency (p50, p99), each stream's decode rate, errors.
The mixed case starts the clients, waits until every stream has its first token, then sends the
long prompt (16 tokens generated); the streams' gaps while it is being read are reported apart.
Rows go to DIR/load.json as they come (with each binary's sha256 and --version line); the server's
log is DIR/LABEL.log."""
from __future__ import annotations

import argparse
import http.client
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

from strata_tools import provenance
from strata_tools.bench import prompt_ids
from strata_tools.bench.probe import arms_of
from strata_tools.device import parity


def percentile(xs: list[float], q: float) -> float | None:
    """The q-th percentile (0-100) by linear interpolation; None for no values."""
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def stream(url: str, prompt: list[int], n: int, first: threading.Event | None = None) -> dict:
    """One streamed completion: when it was sent, when each chunk of tokens came, and any error;
    `first` is set at its first token, or at its end when it has none."""
    u = urlparse(url)
    body = json.dumps({"prompt": prompt, "n_predict": n, "stream": True, "cache_prompt": False, "ignore_eos": True,
                       "temperature": 0, "return_tokens": True})
    out: dict = {"sent": time.monotonic(), "chunks": [], "error": None}
    c = http.client.HTTPConnection(u.hostname, u.port, timeout=3600)
    try:
        c.request("POST", "/completion", body, {"Content-Type": "application/json"})
        r = c.getresponse()
        if r.status != 200:
            out["error"] = f"HTTP {r.status}: {r.read()[:300].decode(errors='replace')}"
            return out
        for raw in r:
            line = raw.decode(errors="replace").strip()
            if not line.startswith("data: "):
                continue
            ev = json.loads(line[6:])
            if "error" in ev:
                out["error"] = str(ev["error"])[:300]
                break
            k = len(ev.get("tokens") or [])
            if k:
                out["chunks"].append((time.monotonic(), k))
                if first is not None:
                    first.set()
            if ev.get("stop"):
                t = ev.get("timings") or {}
                out["prompt_n"], out["predicted_n"] = t.get("prompt_n"), t.get("predicted_n")
                break
    except (OSError, ValueError, http.client.HTTPException) as e:
        out["error"] = f"{type(e).__name__}: {e}"
    finally:
        c.close()
        if first is not None:
            first.set()
    return out


def summary(results: list[dict], t0: float, t1: float) -> dict:
    """The case's figures from its streams' records."""
    ok = [r for r in results if not r["error"]]
    # a token that ends inside a UTF-8 character comes with the next: count what the server generated
    gen = sum(r.get("predicted_n") or sum(k for _, k in r["chunks"]) for r in ok)
    ttft = [(r["chunks"][0][0] - r["sent"]) * 1e3 for r in ok if r["chunks"]]
    gaps = [(b[0] - a[0]) * 1e3 for r in ok for a, b in zip(r["chunks"], r["chunks"][1:])]
    rates = []
    for r in ok:
        ch = r["chunks"]
        if len(ch) > 1 and ch[-1][0] > ch[0][0]:
            rates.append(sum(k for _, k in ch[1:]) / (ch[-1][0] - ch[0][0]))
    return {"requests": len(results), "errors": len(results) - len(ok), "gen_tokens": gen,
            "seconds": round(t1 - t0, 3), "gen_tps": round(gen / (t1 - t0), 2) if t1 > t0 else None,
            "ttft_ms_p50": r2(percentile(ttft, 50)), "ttft_ms_p99": r2(percentile(ttft, 99)),
            "itl_ms_p50": r2(percentile(gaps, 50)), "itl_ms_p99": r2(percentile(gaps, 99)),
            "stream_tps": [round(x, 2) for x in rates],
            "stream_tps_spread": round(max(rates) / min(rates), 3) if rates and min(rates) > 0 else None,
            "error_messages": sorted({r["error"] for r in results if r["error"]})[:5]}


def r2(x: float | None) -> float | None:
    return None if x is None else round(x, 2)


def run_case(url: str, prompts: list[list[list[int]]], gen: int, long_prompt: list[int] | None = None) -> dict:
    """Each client's prompts in turn on a thread of its own; with long_prompt, that prompt is sent
    once every client's first stream has its first token, and the streams' gaps while it is read
    are kept apart."""
    results: list[dict] = []
    lock = threading.Lock()
    firsts = [threading.Event() for _ in prompts]

    def client(c: int) -> None:
        for i, p in enumerate(prompts[c]):
            r = stream(url, p, gen, firsts[c] if i == 0 else None)
            with lock:
                results.append(r)

    threads = [threading.Thread(target=client, args=(c,)) for c in range(len(prompts))]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    out: dict = {}
    if long_prompt is not None:
        for e in firsts:
            e.wait()
        lr = stream(url, long_prompt, 16)
        end = lr["chunks"][0][0] if lr["chunks"] else time.monotonic()
        out["long"] = {"prompt_tokens": lr.get("prompt_n"), "error": lr["error"], "ttft_ms": r2((end - lr["sent"]) * 1e3)}
    for t in threads:
        t.join()
    t1 = time.monotonic()
    out |= summary(results, t0, t1)
    if long_prompt is not None:
        gaps = [(b[0] - a[0]) * 1e3 for r in results if not r["error"]
                for a, b in zip(r["chunks"], r["chunks"][1:]) if b[0] > lr["sent"] and a[0] < end]
        out["itl_ms_p99_during_long"] = r2(percentile(gaps, 99))
        out["itl_ms_max_during_long"] = r2(max(gaps) if gaps else None)
    return out


def slices(tokens: list[int], start: int, count: int, size: int) -> list[list[int]]:
    """count distinct prompts of size tokens from the corpus, from offset start on, wrapping."""
    ring = prompt_ids(tokens, start + count * size)
    return [ring[start + i * size: start + (i + 1) * size] for i in range(count)]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        raise SystemExit(__doc__)
    cut = argv.index("--")
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--corpus", required=True)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--requests", type=int, default=1, help="requests each client sends one after another")
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--gen", type=int, default=256, help="tokens generated a request")
    ap.add_argument("--mixed", type=int, default=0, help="also the mixed case, with a prompt of this many tokens")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv[:cut])
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    text = Path(a.corpus).read_text(errors="replace")
    params = {k: getattr(a, k) for k in ("clients", "requests", "prompt_tokens", "gen", "mixed")}
    results = []
    for label, cmd in arms_of(argv[cut + 1:], "load"):
        arm = {"label": label, "cmd": cmd, "binary": provenance.binary(provenance.command_binary(cmd)), "params": params, "cases": {}}
        results.append(arm)
        with parity.Server(cmd, out / f"{label}.log") as s:
            arm["parallel"] = s.get("/props").get("total_slots")
            tokens = s.post("/tokenize", {"content": text, "add_special": False})["tokens"]
            s.post("/completion", {"prompt": tokens[:64], "n_predict": 8, "cache_prompt": False})
            n = a.clients * a.requests
            flat = slices(tokens, 0, n, a.prompt_tokens)
            per = [flat[c * a.requests:(c + 1) * a.requests] for c in range(a.clients)]
            arm["cases"]["decode"] = run_case(s.url, per, a.gen)
            report(label, "decode", arm["cases"]["decode"])
            (out / "load.json").write_text(json.dumps(results, indent=1))
            if a.mixed:
                # fresh slices after the decode case's, the long prompt after those
                flat = slices(tokens, n * a.prompt_tokens, a.clients, a.prompt_tokens)
                long_prompt = slices(tokens, (n + a.clients) * a.prompt_tokens, 1, a.mixed)[0]
                arm["cases"]["mixed"] = run_case(s.url, [[p] for p in flat], a.gen, long_prompt)
                report(label, "mixed", arm["cases"]["mixed"])
                (out / "load.json").write_text(json.dumps(results, indent=1))
    return 0


def report(label: str, case: str, r: dict) -> None:
    median = statistics.median(r["stream_tps"]) if r["stream_tps"] else 0
    extra = f"  long prompt ttft {r['long']['ttft_ms']} ms, streams' p99 gap meanwhile {r['itl_ms_p99_during_long']} ms" if "long" in r else ""
    print(f"{label:12s} {case:6s} {r['gen_tps']} gen t/s  ttft p50 {r['ttft_ms_p50']} ms  itl p50 {r['itl_ms_p50']} p99 {r['itl_ms_p99']} ms  "
          f"stream median {median:.1f} t/s spread {r['stream_tps_spread']}  errors {r['errors']}{extra}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
