"""Writes a ranked expert profile for an MoE model: runs strata-server over a corpus with
--expert-profile-out, so every (layer, expert) is ranked by how often routing selected it.

    tools/expert-profile --model M.gguf --corpus DIR_OR_FILES... --out PROFILE.json [-- server args]

Each corpus file (or each file under a directory, sorted) is sent once to /completion, cut to
--max-chars, with --n-predict greedy tokens; the prompt and the generated tokens are both counted.
The profile format is docs/expert-profile.md; strata-server reads it with --expert-profile.

    tools/expert-profile --reverse PROFILE.json --out STALE.json

writes a stale profile for benchmarks: each layer's ranking reversed (its most-selected expert
gets the fewest selections), a workload whose routing has moved away from the profile's.
"""
import argparse
import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from strata_tools import REPO, NotReady, free_port, stop, wait_healthy


def corpus_files(items: list[str]) -> list[Path]:
    files: list[Path] = []
    for item in items:
        p = Path(item)
        if p.is_dir():
            files += sorted(f for f in p.rglob("*") if f.is_file())
        elif p.is_file():
            files.append(p)
        else:
            raise SystemExit(f"expert-profile: no such corpus file or directory: {item}")
    if not files:
        raise SystemExit("expert-profile: the corpus is empty")
    return files


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=3600) as r:
        return json.load(r)


def reverse(prof: dict) -> dict:
    """The profile with each layer's selections given to its experts in reverse rank order."""
    by_layer: dict[int, list[list[int]]] = {}
    for e in prof["ranked"]:
        by_layer.setdefault(e[0], []).append(e)
    ranked = []
    for entries in by_layer.values():
        entries.sort(key=lambda e: (-e[2], e[1]))
        hits = [e[2] for e in entries]
        ranked += [[e[0], e[1], h] for e, h in zip(entries, reversed(hits))]
    ranked.sort(key=lambda e: (-e[2], e[0], e[1]))
    out = dict(prof)
    out["ranked"] = ranked
    out["source"] = f"{prof.get('source', '')} (ranking reversed per layer by tools/expert-profile --reverse)"
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model")
    ap.add_argument("--corpus", nargs="+", help="text files or directories")
    ap.add_argument("--reverse", metavar="PROFILE", help="write PROFILE with each layer's ranking reversed to --out")
    ap.add_argument("--out", required=True)
    ap.add_argument("--server", default=str(REPO / "target/release/strata-server"))
    ap.add_argument("--max-chars", type=int, default=16000, help="characters of each file sent (default 16000)")
    ap.add_argument("--n-predict", type=int, default=32)
    ap.add_argument("--log", help="server log file (default: OUT.log)")
    args, extra = ap.parse_known_args()
    extra = [a for a in extra if a != "--"]
    if args.reverse:
        Path(args.out).write_text(json.dumps(reverse(json.loads(Path(args.reverse).read_text())), indent=1) + "\n")
        print(f"expert-profile: {args.out}: {args.reverse} with each layer's ranking reversed")
        return 0
    if not (args.model and args.corpus):
        ap.error("a profile run needs --model and --corpus")
    files = corpus_files(args.corpus)
    out = Path(args.out).resolve()
    out.unlink(missing_ok=True)
    port = free_port()
    log_path = Path(args.log or str(out) + ".log")
    cmd = [args.server, "-m", args.model, "--host", "127.0.0.1", "--port", str(port), "-np", "1",
           "--expert-profile-out", str(out)] + extra
    print("expert-profile: " + " ".join(cmd), flush=True)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log)
        try:
            url = f"http://127.0.0.1:{port}"
            try:
                wait_healthy(url, proc)
            except NotReady as e:
                raise SystemExit(f"expert-profile: strata-server {e}; see {log_path}")
            t0 = time.time()
            n_tokens = 0
            for i, f in enumerate(files):
                text = f.read_text(errors="replace")[: args.max_chars]
                r = post(url + "/completion", {"prompt": text, "n_predict": args.n_predict, "temperature": 0,
                                               "cache_prompt": False})
                n_tokens += r["tokens_evaluated"] + r["tokens_predicted"]
                print(f"  [{i + 1}/{len(files)}] {f}: {r['tokens_evaluated']} + {r['tokens_predicted']} tokens", flush=True)
        finally:
            stop(proc)
    if not out.exists():
        raise SystemExit(f"expert-profile: the server wrote no profile; see {log_path}")
    prof = json.loads(out.read_text())
    hits = [e[2] for e in prof["ranked"]]
    total = sum(hits) or 1
    tenth = max(1, len(hits) // 10)
    print(f"expert-profile: {out}: {len(files)} files, {n_tokens} tokens in {time.time() - t0:.1f} s; "
          f"{len(hits)} experts ranked; the top 10% take {100 * sum(hits[:tenth]) / total:.1f}% of selections")
    return 0


if __name__ == "__main__":
    sys.exit(main())
