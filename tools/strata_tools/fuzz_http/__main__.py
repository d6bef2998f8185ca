"""Differential HTTP fuzzer: the same hostile requests to upstream llama-server and strata-server.

    tools/fuzz-http [--seed N] [--cases N] [--out DIR] [--allow FILE] [--report-only]

(or `python3 -m strata_tools.fuzz_http` with tools/ on PYTHONPATH). Both servers are started with the same flags on the
same model. After every case both must still answer /health; after every abandoned connection
their slots must come free. Reports strata crashes, hangs (no answer where upstream answered),
wedges (unhealthy after a case), slot leaks, its RSS, and every answer that differs from
upstream's and is not on the allow-list. Exit status 1 on any of those, unless --report-only."""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from . import cases as gen
from .compare import allowed, differences, load_allow, summarize
from .wire import Answer, abandon, exchange, pipeline, request_bytes

from strata_tools import REPO, free_port, provenance

CASE_TIMEOUT = 90.0
MALFORMED_TIMEOUT = 10.0
HEALTH_TIMEOUT = 20.0


# Each server's address space: a case that makes llama.cpp allocate without end (a grammar
# repetition {5,2} in upstream) fails that server's allocation instead of waking the kernel's
# OOM killer, which may pick the other server or the fuzzer.
ADDRESS_SPACE = 8 << 30


def limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))


class Server:
    def __init__(self, name: str, binary: Path, args: list[str], workdir: Path):
        self.name, self.binary, self.args = name, binary, args
        self.log = workdir / f"{name}.log"
        self.slots = workdir / f"{name}-slots"
        self.slots.mkdir(parents=True, exist_ok=True)
        self.proc: subprocess.Popen | None = None
        self.port = 0
        self.starts = 0

    def start(self) -> None:
        self.port = free_port()
        cmd = [str(self.binary), *self.args, "--slot-save-path", str(self.slots), "--host", "127.0.0.1",
               "--port", str(self.port)]
        with open(self.log, "ab") as log:
            log.write(f"\n==> start {self.starts}: {' '.join(cmd)}\n".encode())
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=log, start_new_session=True, preexec_fn=limit_memory)
        self.starts += 1
        deadline = time.time() + 300
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"fuzz-http: {self.name} exited at start-up (log: {self.log})")
            a = exchange(self.port, request_bytes("GET", "/health", None), 2)
            if a.status == 200:
                return
            time.sleep(0.2)
        raise SystemExit(f"fuzz-http: {self.name} did not become ready (log: {self.log})")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def healthy(self) -> bool:
        return self.alive() and exchange(self.port, request_bytes("GET", "/health", None), HEALTH_TIMEOUT).status == 200

    def slots_free(self, timeout: float = 30.0) -> bool:
        deadline = time.time() + timeout
        while time.time() < deadline:
            a = exchange(self.port, request_bytes("GET", "/slots", None), 10)
            try:
                if a.status == 200 and not any(s.get("is_processing") for s in json.loads(a.body)):
                    return True
            except (ValueError, AttributeError):
                return False
            time.sleep(0.2)
        return False

    def rss_mib(self) -> float:
        try:
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        except (OSError, AttributeError):
            pass
        return 0.0

    def tail(self, n: int = 25) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()

    def restart(self) -> None:
        self.stop()
        self.start()


# What a /slots entry always shows; the rest describes the task the slot ran last, which depends
# on the server's history (a restart after a crash empties it) more than on the request.
SLOT_KEYS = {"id", "n_ctx", "speculative", "is_processing"}


def run_case(case: gen.Case, srv: Server) -> dict:
    port = srv.port
    if case.wire in ("http", "slow"):
        body = case.body() if callable(case.body) else case.body
        data = request_bytes(case.method, case.path, body, case.headers)
        a = exchange(port, data, CASE_TIMEOUT, pieces=12 if case.wire == "slow" else 1,
                     gap=0.08 if case.wire == "slow" else 0.0)
        s = summarize(a)
        if case.method == "GET" and case.path.startswith("/slots") and isinstance(s.get("shape"), list):
            s["shape"] = [{k: v for k, v in slot.items() if k in SLOT_KEYS} for slot in s["shape"] if isinstance(slot, dict)]
        return s
    if case.wire == "raw":
        return summarize(exchange(port, case.raw, CASE_TIMEOUT if case.complete else MALFORMED_TIMEOUT))
    if case.wire == "idle":
        # a client that sends half a request and waits must not keep others out
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        try:
            s.sendall(case.raw)
            h = exchange(port, request_bytes("GET", "/health", None), 10)
        finally:
            s.close()
        return {"status": h.status, "what": "health while a connection idles"}
    if case.wire in ("abandon", "abandon-stream"):
        r = abandon(port, case.raw, read_first=200 if case.wire == "abandon-stream" else 0, hold=0.3)
        return {"status": "abandoned", "what": r, "slots_free": srv.slots_free()}
    if case.wire == "pipeline":
        return {"statuses": [summarize(a) for a in pipeline(port, [case.raw], CASE_TIMEOUT)]}
    raise ValueError(case.wire)


def compare(u: dict, s: dict) -> list[str]:
    if "statuses" in u or "statuses" in s:
        us, ss = u.get("statuses", []), s.get("statuses", [])
        if len(us) != len(ss):
            return [f"pipeline answers {len(us)} vs {len(ss)}"]
        return [d for a, b in zip(us, ss) for d in differences(a, b)]
    if u.get("status") == "abandoned":
        return [] if s.get("slots_free") or not u.get("slots_free") else ["slots stay busy after a disconnect"]
    return differences(u, s)


def main() -> int:
    ap = argparse.ArgumentParser(prog="fuzz-http", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--cases", type=int, default=1000)
    ap.add_argument("--out", type=Path, default=REPO / "target/fuzz-http")
    ap.add_argument("--allow", type=Path, default=Path(__file__).with_name("allow.txt"))
    ap.add_argument("--upstream", type=Path, default=REPO / "target/upstream/bin/llama-server")
    ap.add_argument("--strata", type=Path, default=REPO / "target/release/strata-server")
    ap.add_argument("--model", type=Path, default=Path(os.environ.get("STRATA_MODELS", REPO / ".cache/models"))
                    / "gemma3-270m-q4_k_m.gguf")
    ap.add_argument("--report-only", action="store_true", help="exit 0 whatever was found")
    ap.add_argument("--only", help="run only cases whose key contains this text")
    args = ap.parse_args()

    allow = load_allow(args.allow) if args.allow.exists() else []
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="fuzz-http-", dir=args.out))
    flags = ["-m", str(args.model), "-c", "1024", "-np", "4", "-n", "8", "--metrics", "--props", "-t", "1",
             "--no-warmup"]
    servers = {"upstream": Server("upstream", args.upstream, flags, work),
               "strata": Server("strata", args.strata, flags, work)}
    for s in servers.values():
        s.start()
    case_list = gen.generate(args.seed, args.cases)
    if args.only:
        case_list = [c for c in case_list if args.only in c.key]

    counts = Counter()
    findings: list[dict] = []
    diff_classes: dict[str, list[dict]] = defaultdict(list)
    allowed_classes: Counter = Counter()
    rss = {"start": servers["strata"].rss_mib(), "max": 0.0}
    upstream_rss_max = 0.0
    t0 = time.time()
    with ThreadPoolExecutor(2) as pool:
        for n, case in enumerate(case_list, 1):
            fu = pool.submit(run_case, case, servers["upstream"])
            fs = pool.submit(run_case, case, servers["strata"])
            u, s = fu.result(), fs.result()
            counts["cases"] += 1
            record = {"id": case.id, "key": case.key, "upstream": u, "strata": s}
            if not servers["upstream"].alive():
                counts["upstream crashes"] += 1
                findings.append({**record, "finding": "upstream crash", "log": servers["upstream"].tail()})
                servers["upstream"].restart()
            elif not servers["upstream"].healthy():
                counts["upstream wedged"] += 1
                findings.append({**record, "finding": "upstream wedged"})
                servers["upstream"].restart()
            failure = None
            if not servers["strata"].alive():
                failure = "STRATA CRASH"
            elif s.get("status") is None and s.get("failure") == "timeout" and u.get("status") is not None and case.complete:
                failure = "STRATA HANG"
            elif not servers["strata"].healthy():
                failure = "STRATA WEDGED"
            elif u.get("status") == "abandoned" and not s.get("slots_free"):
                failure = "STRATA SLOT LEAK"
            if failure:
                counts[failure] += 1
                findings.append({**record, "finding": failure, "log": servers["strata"].tail()})
                print(f"fuzz-http: case {case.id} {case.key}: {failure}", file=sys.stderr)
                servers["strata"].restart()
            elif any(f.get("finding") == "upstream crash" and f["id"] == case.id for f in findings[-1:]):
                pass  # upstream died on it: nothing to compare against
            else:
                diffs = compare(u, s)
                if diffs:
                    a = allowed(case.key, allow)
                    if a:
                        counts["allowed differences"] += 1
                        allowed_classes[a.pattern] += 1
                    else:
                        counts["differences"] += 1
                        cls = f"{case.key.split(' ')[0]} {case.key.split(' ')[1]} {_field(case.key)}: {diffs[0]}"
                        diff_classes[cls].append({**record, "diffs": diffs})
                else:
                    counts["same"] += 1
            if n % 25 == 0 or n == len(case_list):
                r = servers["strata"].rss_mib()
                rss["max"] = max(rss["max"], r)
                upstream_rss_max = max(upstream_rss_max, servers["upstream"].rss_mib())
                el = time.time() - t0
                print(f"fuzz-http: {n}/{len(case_list)} cases, {el:.0f} s, strata RSS {r:.0f} MiB, "
                      f"{counts['differences']} differences, {sum(counts[k] for k in counts if k.startswith('STRATA'))} failures",
                      file=sys.stderr)
    rss["end"] = servers["strata"].rss_mib()
    for s in servers.values():
        s.stop()

    failures = sum(v for k, v in counts.items() if k.startswith("STRATA"))
    if not failures:
        # the servers' logs and saved slots matter only where strata failed
        shutil.rmtree(work, ignore_errors=True)
    report = {
        "seed": args.seed, "cases": len(case_list), "seconds": round(time.time() - t0, 1),
        "flags": flags, "binaries": {"upstream": provenance.binary(args.upstream), "strata": provenance.binary(args.strata)},
        "counts": dict(counts), "strata_rss_mib": rss, "upstream_rss_max_mib": upstream_rss_max,
        "restarts": {k: v.starts - 1 for k, v in servers.items()},
        "findings": findings,
        "difference_classes": {k: {"count": len(v), "examples": v[:3]} for k, v in sorted(diff_classes.items())},
        "allowed": dict(allowed_classes),
    }
    (args.out / "report.json").write_text(json.dumps(report, indent=1, default=str))
    (args.out / "summary.md").write_text(_summary(report))
    print(_summary(report, brief=True), file=sys.stderr)
    bad = failures or counts["differences"]
    return 1 if bad and not args.report_only else 0


def _field(key: str) -> str:
    rest = key.split(" ", 2)[2] if key.count(" ") >= 2 else ""
    return rest.split("=")[0].split(" ")[0]


def _summary(r: dict, brief: bool = False) -> str:
    c = r["counts"]
    lines = [f"# fuzz-http: seed {r['seed']}, {r['cases']} cases, {r['seconds']} s", ""]
    for name, b in r.get("binaries", {}).items():
        lines.append(f"- {name}: `{b['path']}`: `{b.get('version', b.get('error'))}`, sha256 `{b.get('sha256')}`")
    lines += ["", "| outcome | cases |", "|---|---|"]
    for k in sorted(c):
        lines.append(f"| {k} | {c[k]} |")
    rss = r["strata_rss_mib"]
    lines += ["", f"strata-server RSS: {rss['start']:.0f} MiB at start, {rss['max']:.0f} MiB at most, "
                  f"{rss['end']:.0f} MiB at the end (upstream at most {r['upstream_rss_max_mib']:.0f} MiB); "
                  f"restarts: {r['restarts']}", ""]
    if r["findings"]:
        lines += ["## Findings", ""]
        for f in r["findings"][: 10 if brief else 200]:
            lines.append(f"- case {f['id']} `{f['key']}`: **{f['finding']}**")
    if r["difference_classes"]:
        lines += ["", "## Differences not on the allow-list", ""]
        for k, v in list(r["difference_classes"].items())[: 30 if brief else 10_000]:
            ex = v["examples"][0]
            lines.append(f"- {k} ({v['count']}x), e.g. case {ex['id']} `{ex['key'][:160]}`")
            if not brief:
                lines.append(f"  - upstream: `{json.dumps(ex['upstream'])[:300]}`")
                lines.append(f"  - strata: `{json.dumps(ex['strata'])[:300]}`")
    if r["allowed"] and not brief:
        lines += ["", "## Allowed differences (tools/strata_tools/fuzz_http/allow.txt)", ""]
        for k, v in sorted(r["allowed"].items()):
            lines.append(f"- `{k}`: {v}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
