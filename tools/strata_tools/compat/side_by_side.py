"""Sends the same requests, in order, to upstream llama-server and to strata-server started with
the same flags, and prints whether the content and the cache/draft timings agree.

    side_by_side.py SCENARIOS.json [--only NAME] [--out RESULT.md]

SCENARIOS.json: [{"name", "args": [server flags], "requests": [{"path"?: "/completion",
"method"?: "GET", ...body}]}]; a GET's whole answer is compared.
Paths of models in args are relative to the repository. Exit status 1 if any request differs.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from strata_tools import REPO, provenance
from strata_tools.compat.report import binary_line

SERVERS = {"upstream": REPO / "target/upstream/bin/llama-server", "strata": REPO / "target/release/strata-server"}
KEYS = ["cache_n", "prompt_n", "predicted_n", "draft_n", "draft_n_accepted"]


def start(binary: Path, args: list[str], port: int) -> subprocess.Popen:
    proc = subprocess.Popen([str(binary), "--host", "127.0.0.1", "--port", str(port), *args], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(600):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                if json.load(r).get("status") == "ok":
                    return proc
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit(f"{binary} did not start")


def post(port: int, req: dict) -> dict:
    body = {k: v for k, v in req.items() if k not in ("path", "method")}
    data = None if req.get("method") == "GET" else json.dumps(body).encode()
    r = urllib.request.Request(f"http://127.0.0.1:{port}{req.get('path', '/completion')}", data=data,
                               headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(r, timeout=600) as res:
            return json.load(res)
    except urllib.error.HTTPError as e:
        return {"http_error": e.code, "body": json.loads(e.read() or b"{}")}


def content(res):
    if not isinstance(res, dict):
        return res
    if "choices" in res:
        msg = res["choices"][0].get("message", {})
        return msg.get("content"), msg.get("reasoning_content")
    return res.get("content", res.get("http_error"))


def run(scenario: dict, port: int) -> tuple[bool, list[str]]:
    results = {}
    for name, binary in SERVERS.items():
        proc = start(binary, scenario["args"], port)
        try:
            results[name] = [post(port, r) for r in scenario["requests"]]
        finally:
            proc.terminate()
            proc.wait()
    ok = True
    lines = []
    for i, (u, s) in enumerate(zip(results["upstream"], results["strata"])):
        tu = {k: (u.get("timings") or {}).get(k) for k in KEYS} if isinstance(u, dict) else {}
        ts = {k: (s.get("timings") or {}).get(k) for k in KEYS} if isinstance(s, dict) else {}
        same = content(u) == content(s) and tu == ts
        ok &= same
        shown = {k: v for k, v in tu.items() if v is not None}
        lines.append(f"| {scenario['name']} | {i} | {'same' if same else 'DIFFERENT'} | {shown} |"
                     + ("" if tu == ts else f" strata: { {k: v for k, v in ts.items() if v is not None} } |"))
    return ok, lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("scenarios")
    ap.add_argument("--only")
    ap.add_argument("--out")
    ap.add_argument("--port", type=int, default=18611)
    args = ap.parse_args()
    scenarios = json.loads(Path(args.scenarios).read_text())
    rows, all_ok = [], True
    for sc in scenarios:
        if args.only and sc["name"] != args.only:
            continue
        ok, lines = run(sc, args.port)
        all_ok &= ok
        rows += lines
        print("\n".join(lines), flush=True)
    if args.out:
        head = ["# Upstream llama-server and strata-server, same flags, same requests", "",
                f"Command: `tools/compat/side_by_side.py {args.scenarios}` (scenarios in that file); "
                f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. 'same': equal content (or whole answer) and "
                "equal cache_n/prompt_n/predicted_n/draft_n/draft_n_accepted.", ""]
        head += [f"- {name}: {binary_line(provenance.binary(path))}" for name, path in SERVERS.items()]
        head += ["", "| scenario | request | upstream vs strata | upstream timings |", "|---|---|---|---|"]
        Path(args.out).write_text("\n".join(head + rows) + "\n")
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
