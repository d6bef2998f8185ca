"""Greedy parity of two servers on one prompt. A (the reference) generates N tokens. B generates
its own N tokens (free-running), then is teacher-forced along A's tokens: at each step B is given
the prompt plus A's tokens so far (one new token each time, from B's prompt cache) and reports its
top-5 log-probabilities. Two different devices round differently, so a random model's near-ties can
flip a free-running sequence; the forced pass checks every step on the same context instead.

    tools/device/parity --out DIR --prompt-file F [--n 256] [--tol 0.05] -- A-CMD... --- B-CMD...

Passes when, at every forced step, B's top-1 is A's token or trails it by at most --tol in A's
log-probabilities (a near-tie), and no shared top-5 log-probability differs by more than --tol.
A token that ends inside a UTF-8 character has no probabilities (as in llama-server); such steps
are unmeasured, and at least 75% of the steps must be measured.
Writes DIR/parity.json (and B's /metrics to DIR/metrics-b.txt where it serves them), prints one line per arm and the verdict, exits 1 when it fails.
"""
import argparse
import hashlib
import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from strata_tools import NotReady, free_port, get_json, post_json, provenance, stop, wait_healthy


class Server:
    """One server process on a free loopback port, stopped on exit."""

    def __init__(self, cmd: list[str], log: Path):
        self.cmd, self.log = cmd, log

    def __enter__(self) -> "Server":
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.f = open(self.log, "wb")
        self.proc = subprocess.Popen(self.cmd + ["--host", "127.0.0.1", "--port", str(port)],
                                     stdout=subprocess.DEVNULL, stderr=self.f)
        try:
            wait_healthy(self.url, self.proc, poll=0.5)
        except NotReady as e:
            raise SystemExit(f"parity: {self.cmd[0]} {e}; see {self.log}")
        return self

    def __exit__(self, *exc) -> None:
        stop(self.proc)
        self.f.close()

    def post(self, path: str, body: dict) -> dict:
        return post_json(self.url + path, body)

    def get(self, path: str) -> dict:
        return get_json(self.url + path)

    def complete(self, prompt, n: int, cache: bool) -> dict:
        return self.post("/completion", {"prompt": prompt, "n_predict": n, "temperature": 0, "top_k": 1, "n_probs": 5,
                                         "cache_prompt": cache, "ignore_eos": True, "return_tokens": True})


def forced(srv: Server, prompt: str, tokens: list[int]) -> list[list[dict]]:
    """B's top-5 at each step of A's sequence, each request one token past the cached previous one."""
    ids = srv.post("/tokenize", {"content": prompt, "add_special": True})["tokens"]
    steps = []
    for i in range(len(tokens)):
        # Step 0 evaluates the whole prompt as A did (a cached prompt would re-evaluate its last token alone).
        r = srv.complete(ids + tokens[:i], 1, i > 0)
        # A token that ends inside a UTF-8 character has no entry (as in llama-server): unmeasured.
        probs = r.get("completion_probabilities") or []
        steps.append(probs[0]["top_logprobs"] if probs and probs[0]["id"] == r["tokens"][0] else [])
    return steps


def by_step(answer: dict) -> list[list[dict] | None]:
    """Each generated token's top-5, or None where it has no entry (it ends inside a UTF-8
    character; the next token's entry carries its bytes)."""
    out, pa, j = [], answer["completion_probabilities"], 0
    for tok in answer["tokens"]:
        if j < len(pa) and pa[j]["id"] == tok:
            out.append(pa[j]["top_logprobs"])
            j += 1
        else:
            out.append(None)
    return out


def compare(a: dict, b: dict, tol: float) -> dict:
    """Free-running: the same tokens, and log-probabilities within tol while the contexts agree."""
    ta, tb = a["tokens"], b["tokens"]
    first_diff = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), None)
    if first_diff is None and len(ta) != len(tb):
        first_diff = min(len(ta), len(tb))
    sa, sb = by_step(a), by_step(b)
    max_d, margin = 0.0, None
    for x, y in list(zip(sa, sb))[:first_diff]:
        if x and y:
            lb = {e["id"]: e["logprob"] for e in y}
            for e in x:
                if e["id"] in lb:
                    max_d = max(max_d, abs(e["logprob"] - lb[e["id"]]))
    if first_diff is not None and first_diff < len(sa) and sa[first_diff] and len(sa[first_diff]) > 1:
        top = sa[first_diff]
        margin = top[0]["logprob"] - top[1]["logprob"]
    return {"n": len(ta), "tokens_equal": ta == tb, "first_difference": first_diff,
            "reference_margin_near_difference": margin, "max_abs_logprob_difference": max_d, "tolerance": tol,
            "pass": ta == tb and max_d <= tol}


def compare_forced(a: dict, steps: list[list[dict]], tol: float) -> dict:
    """A's tokens and top-5 against B's top-5 on A's context, step by step. Steps where either
    side has no entry (a token ending inside a UTF-8 character) are counted as unmeasured."""
    ta, ref_at = a["tokens"], by_step(a)
    max_d, flips, worst_flip, unmeasured = 0.0, [], 0.0, 0
    for i, (tok, ref, got) in enumerate(zip(ta, ref_at, steps)):
        if not ref or not got:
            unmeasured += 1
            continue
        la = {e["id"]: e["logprob"] for e in ref}
        lb = {e["id"]: e["logprob"] for e in got}
        for t in la.keys() & lb.keys():
            max_d = max(max_d, abs(la[t] - lb[t]))
        top_b = got[0]["id"]
        if top_b != tok:
            # How far B's choice trails A's token in A's own log-probabilities (beyond top-5: unbounded).
            gap = la[tok] - la[top_b] if top_b in la else float("inf")
            flips.append({"step": i, "reference": tok, "candidate": top_b, "reference_gap": gap})
            worst_flip = max(worst_flip, gap)
    measured = len(steps) - unmeasured
    ok = measured >= 0.75 * len(steps) and max_d <= tol and worst_flip <= tol
    return {"steps": len(steps), "measured_steps": measured, "top1_equal_steps": measured - len(flips),
            "near_tie_flips": flips, "max_abs_logprob_difference": max_d, "tolerance": tol, "pass": ok}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--prompt-file", required=True)
    ap.add_argument("--n", type=int, default=256)
    ap.add_argument("--tol", type=float, default=0.05, help="largest |difference| of top-5 log-probabilities")
    args, rest = ap.parse_known_args()
    rest = [a for a in rest if a != "--"]
    if "---" not in rest:
        ap.error("give two commands separated by ---")
    i = rest.index("---")
    cmds = {"a": rest[:i], "b": rest[i + 1:]}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prompt = Path(args.prompt_file).read_text(errors="replace")
    t0 = time.time()
    with Server(cmds["a"], out / "parity-a.log") as srv:
        a = srv.complete(prompt, args.n, False)
    print(f"parity a: {' '.join(cmds['a'])}: {a['tokens_predicted']} tokens in {time.time() - t0:.1f} s", flush=True)
    t0 = time.time()
    with Server(cmds["b"], out / "parity-b.log") as srv:
        b = srv.complete(prompt, args.n, False)
        print(f"parity b: {' '.join(cmds['b'])}: {b['tokens_predicted']} tokens in {time.time() - t0:.1f} s", flush=True)
        t0 = time.time()
        steps = forced(srv, prompt, a["tokens"])
        print(f"parity b forced along a: {len(steps)} steps in {time.time() - t0:.1f} s", flush=True)
        try:
            # B's counters (e.g. how many passes the prefill ring took), where it serves /metrics.
            (out / "metrics-b.txt").write_bytes(urllib.request.urlopen(srv.url + "/metrics", timeout=10).read())
        except OSError:
            pass
    free = compare(a, b, args.tol)
    verdict = compare_forced(a, steps, args.tol)
    verdict["free_running"] = free
    # The prompt is pin source text: the results keep its size and hash, not the text.
    text = {"prompt_file": args.prompt_file, "prompt_chars": len(prompt), "prompt_sha256": hashlib.sha256(prompt.encode()).hexdigest()}
    a, b = ({k: v for k, v in r.items() if k != "prompt"} for r in (a, b))
    bins = {k: provenance.binary(provenance.command_binary(c)) for k, c in cmds.items()}
    (out / "parity.json").write_text(json.dumps({"commands": cmds, "binaries": bins, "prompt": text, "verdict": verdict, "a": a, "b": b, "b_forced": steps},
                                                indent=1))
    print("parity: " + json.dumps(verdict), flush=True)
    return 0 if verdict["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
