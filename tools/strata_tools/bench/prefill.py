"""Prefill/decode benchmark of one llama-server-compatible server (upstream llama-server or
strata-server), in the fixed request order Strata's A/B results use.

    tools/bench/prefill --model NAME --url http://127.0.0.1:8080 --engine-log LOG \\
                        --binary SERVER --label LABEL --output OUT.json [--quick]
    tools/bench/prefill --compare CONTROL.json CANDIDATE.json [...] [--chart OUT.png]

One run sends, on one idle server: a small warmup, then fresh prompts of 140, 280, 140 and 280
generated functions (about 4.2k and 8.8k tokens with a Qwen-class tokenizer), each followed by
one follow-up turn that continues its conversation. Every prompt is a deterministic synthetic
source file; the two prompts of the same size differ in content. Fresh prompts go with
cache_prompt false and must report zero reused KV tokens; follow-ups reuse what they can.
Output is capped at 128 tokens (throughput, not task success); sampling is greedy
(temperature 0, top-k 1, top-p 1, min-p 0, seed 42) with reasoning disabled.

The server's stderr must be written unbuffered to --engine-log. Each request must add exactly
one completed timing record there ("prompt eval time", "eval time", "total time" of one task);
its prompt and generated token counts must match the response, or the run fails. Cancelled
requests print no such record, so no cancelled line can be taken as evidence.

--binary names the server's executable: the run records its sha256 and the first line of its
--version (and strata-server's commit from it).

--quick uses small prompts and a 16-token cap, for CPU smoke tests.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from strata_tools import get_json, provenance

SAMPLING = {"temperature": 0.0, "top_k": 1, "top_p": 1.0, "min_p": 0.0, "seed": 42}
FULL = {"warmup": 8, "fresh": [140, 280, 140, 280], "max_tokens": 128}
QUICK = {"warmup": 2, "fresh": [10, 20, 10, 20], "max_tokens": 16}
FOLLOW_UP = "Which of these functions returns the largest value for x = 3 and y = 5? Answer briefly."

TIMING_RE = re.compile(
    r"id\s+(?P<slot>\d+) \| task (?P<task>-?\d+) \| +(?P<what>prompt eval time|eval time|total time) = +"
    r"(?P<ms>[\d.]+) ms / +(?P<n>\d+) (?:tokens|runs)"
)


def source_file(n_functions: int, variant: int) -> str:
    """A deterministic Python module of n_functions one-line functions (about 30 tokens each
    with a Qwen tokenizer); `variant` changes every name and constant, so two prompts of one
    size share almost nothing."""
    lines = [f"# module {variant}", ""]
    for i in range(n_functions):
        a, b, c = (i * 7 + variant * 13) % 97 + 1, (i * 11 + variant * 5) % 89 + 2, (i * 3 + variant) % 9 + 12
        lines += [f"def f{variant}_{i}(x, y):", f"    return (x * {a} - y * {b}) % {c}", ""]
    return "\n".join(lines)


def user_prompt(n_functions: int, variant: int) -> str:
    return ("Here is a Python module:\n\n```python\n" + source_file(n_functions, variant) +
            "```\n\nDescribe what this module does.")


def post(url: str, body: dict, timeout: float = 3600.0) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.load(r)
    except urllib.error.HTTPError as e:
        raise SystemExit(f"prefill: {url} answered {e.code}: {e.read().decode(errors='replace')}")


def timing_records(text: str) -> list[dict]:
    """Completed timing records: a task's prompt eval, eval and total lines, in log order."""
    records: dict[tuple[str, str], dict] = {}
    order = []
    for m in TIMING_RE.finditer(text):
        key = (m["slot"], m["task"])
        rec = records.get(key)
        if rec is None or m["what"] == "prompt eval time" and "total" in rec:
            rec = records[key] = {"slot": int(m["slot"]), "task": int(m["task"])}
            order.append(rec)
        name = {"prompt eval time": "prompt", "eval time": "eval", "total time": "total"}[m["what"]]
        rec[name + "_ms"] = float(m["ms"])
        rec[name + "_n"] = int(m["n"])
        if name == "total":
            rec["total"] = True
    return [r for r in order if r.get("total") and "prompt_ms" in r and "eval_ms" in r]


class EngineLog:
    def __init__(self, path: Path):
        self.path = path
        self.offset = path.stat().st_size if path.exists() else 0

    def new_records(self) -> list[dict]:
        """The completed records written since the last call (waits briefly for a flush)."""
        for _ in range(50):
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                chunk = f.read()
            recs = timing_records(chunk.decode(errors="replace"))
            if recs:
                break
            time.sleep(0.1)
        self.offset += len(chunk)
        return recs


def run_request(args, log: EngineLog, kind: str, n_functions: int, messages: list[dict], max_tokens: int,
                fresh: bool) -> tuple[dict, str]:
    body = {
        "model": args.model,
        "messages": messages,
        "max_tokens": max_tokens,
        "stream": False,
        "cache_prompt": not fresh,
        "chat_template_kwargs": {"enable_thinking": False},
        "reasoning_format": "none",
        **SAMPLING,
    }
    t0 = time.perf_counter()
    res = post(args.url.rstrip("/") + "/v1/chat/completions", body)
    wall = time.perf_counter() - t0
    t = res.get("timings") or {}
    choice = res["choices"][0]
    recs = log.new_records()
    if len(recs) != 1:
        raise SystemExit(f"prefill: {kind} request added {len(recs)} completed timing records to "
                         f"{log.path}, expected exactly 1 (is the log unbuffered and the server idle?)")
    rec = recs[0]
    prompt_n = t.get("prompt_n")
    if rec["prompt_n"] != prompt_n or rec["eval_n"] != t.get("predicted_n"):
        raise SystemExit(f"prefill: engine log record {rec} does not match the response timings {t}")
    if fresh and t.get("cache_n", 0) != 0:
        raise SystemExit(f"prefill: fresh prompt reused {t.get('cache_n')} KV tokens, expected 0")
    out = {
        "kind": kind,
        "n_functions": n_functions,
        "prompt_tokens": res.get("usage", {}).get("prompt_tokens"),
        "cache_n": t.get("cache_n"),
        "prompt_n": prompt_n,
        "prompt_ms": t.get("prompt_ms"),
        "prefill_tps": t.get("prompt_per_second"),
        "predicted_n": t.get("predicted_n"),
        "predicted_ms": t.get("predicted_ms"),
        "decode_tps": t.get("predicted_per_second"),
        # speculative decoding: tokens drafted and accepted (absent without drafting)
        "draft_n": t.get("draft_n"),
        "draft_n_accepted": t.get("draft_n_accepted"),
        "wall_s": round(wall, 4),
        "stop_reason": choice.get("finish_reason"),
        "engine_log": rec,
    }
    return out, choice["message"].get("content") or ""


def run(args) -> dict:
    shape = QUICK if args.quick else FULL
    log_path = Path(args.engine_log)
    if not log_path.exists():
        raise SystemExit(f"prefill: engine log {log_path} does not exist")
    base = args.url.rstrip("/")
    health = get_json(base + "/health")
    if health.get("status") != "ok":
        raise SystemExit(f"prefill: server not ready: {health}")
    props = get_json(base + "/props")
    binary = provenance.binary(args.binary)
    log = EngineLog(log_path)
    requests = []
    conv = [{"role": "user", "content": user_prompt(shape["warmup"], 0)}]
    warm, _ = run_request(args, log, "warmup", shape["warmup"], conv, shape["max_tokens"], fresh=True)
    requests.append(warm)
    for k, n in enumerate(shape["fresh"], start=1):
        conv = [{"role": "user", "content": user_prompt(n, k)}]
        rec, answer = run_request(args, log, "fresh", n, conv, shape["max_tokens"], fresh=True)
        requests.append(rec)
        conv += [{"role": "assistant", "content": answer}, {"role": "user", "content": FOLLOW_UP}]
        rec, _ = run_request(args, log, "follow-up", n, conv, shape["max_tokens"], fresh=False)
        requests.append(rec)
    return {
        "label": args.label,
        "model": args.model,
        "url": args.url,
        "quick": args.quick,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "sampling": SAMPLING,
        "max_tokens": shape["max_tokens"],
        "server": {"build_info": props.get("build_info"), "model_path": props.get("model_path"),
                   "n_ctx": (props.get("default_generation_settings") or {}).get("n_ctx"),
                   "total_slots": props.get("total_slots")},
        "binary": binary,
        "requests": requests,
    }


def fresh_rows(run_json: dict) -> list[dict]:
    return [r for r in run_json["requests"] if r["kind"] == "fresh"]


def compare(paths: list[str], chart: str | None) -> str:
    runs = [json.loads(Path(p).read_text()) for p in paths]
    base, rest = runs[0], runs[1:]
    n_rows = len(fresh_rows(base))
    for r in runs:
        if len(fresh_rows(r)) != n_rows:
            raise SystemExit(f"prefill: {r['label']} has {len(fresh_rows(r))} fresh requests, {base['label']} {n_rows}")
    head = ["Fresh request, execution order", f"{base['label']} prefill t/s"]
    for r in rest:
        head += [f"{r['label']} prefill t/s", f"{r['label']} / {base['label']}", f"{r['label']} output t/s",
                 f"{r['label']} request wall time"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    seen: set[int] = set()
    for i in range(n_rows):
        b = fresh_rows(base)[i]
        size = b["n_functions"]
        when = "first use" if size not in seen else "warmed"
        if size not in seen and i > 0:
            when = "first use at this size"
        seen.add(size)
        cells = [f"{b['prompt_n']:,} tokens, {when}", f"{b['prefill_tps']:.1f}"]
        for r in rest:
            c = fresh_rows(r)[i]
            cells += [f"{c['prefill_tps']:.1f}", f"{c['prefill_tps'] / b['prefill_tps']:.2f}x",
                      f"{c['decode_tps']:.1f}", f"{c['wall_s']:.3f} s"]
        lines.append("| " + " | ".join(cells) + " |")
    decode = "; ".join(f"{r['label']} decode t/s " + ", ".join(f"{x['decode_tps']:.1f}" for x in fresh_rows(r)) for r in runs)
    lines += ["", "Output tokens and stop reasons: " + "; ".join(
        f"{r['label']} " + ", ".join(f"{x['predicted_n']} {x['stop_reason']}" for x in fresh_rows(r)) for r in runs),
        "Decode: " + decode]
    table = "\n".join(lines)
    if chart:
        try:
            write_chart(runs, chart)
        except ImportError:
            print("prefill: no matplotlib here, chart skipped (run --compare again where it is)", file=sys.stderr)
    return table


def write_chart(runs: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(fresh_rows(runs[0]))
    width = 0.8 / len(runs)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for j, r in enumerate(runs):
        xs = [i + j * width for i in range(n)]
        ax.bar(xs, [x["prefill_tps"] for x in fresh_rows(r)], width, label=r["label"])
    ax.set_xticks([i + 0.4 - width / 2 for i in range(n)])
    ax.set_xticklabels([f"{x['prompt_n']:,} tok\n#{i + 1}" for i, x in enumerate(fresh_rows(runs[0]))])
    ax.set_ylabel("prefill tokens/s")
    ax.set_title(f"Fresh-prompt prefill, {runs[0]['model']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="model name sent with each request")
    ap.add_argument("--url", default="http://127.0.0.1:8080")
    ap.add_argument("--engine-log", help="the server's unbuffered stderr log")
    ap.add_argument("--binary", help="the server's executable (its sha256 and --version go into the result)")
    ap.add_argument("--label", help="name of this arm (control, candidate, ...)")
    ap.add_argument("--output", help="where to write the run's JSON")
    ap.add_argument("--quick", action="store_true", help="small prompts and a 16-token cap (CPU smoke test)")
    ap.add_argument("--compare", nargs="+", metavar="RUN.json", help="print the table of these runs (first = control)")
    ap.add_argument("--chart", help="with --compare: write a PNG bar chart of prefill t/s here")
    args = ap.parse_args(argv)
    if args.compare:
        print(compare(args.compare, args.chart))
        return 0
    missing = [f for f in ("model", "engine_log", "binary", "label", "output") if getattr(args, f) is None]
    if missing:
        ap.error("a run needs " + ", ".join("--" + m.replace("_", "-") for m in missing))
    if not Path(args.binary).is_file():
        raise SystemExit(f"prefill: no such server binary: {args.binary}")
    result = run(args)
    Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
    for r in result["requests"]:
        print(f"{r['kind']:9} {r['n_functions']:4} fn  prompt {r['prompt_n']:6} (cache {r['cache_n']:6})  "
              f"prefill {r['prefill_tps']:9.1f} t/s  decode {r['decode_tps']:7.1f} t/s  wall {r['wall_s']:7.3f} s  "
              f"{r['predicted_n']} {r['stop_reason']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
