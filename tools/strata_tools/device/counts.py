"""Selections counted per layer, with requests served one at a time and together. The same
strata-server command serves PROMPTS twice: with -np 1, one request after another, and with
-np K, all at once; each writes --expert-profile-out. Every token a layer computes selects
n_used experts whichever way it was batched, so the per-layer totals must be equal (a routing
log that a later ubatch overwrote before it was read falls short).

    tools/device/counts --out DIR --prompt-file F [--k 4] [--n 32] -- STRATA-CMD...

Writes DIR/counts.json, prints one line per run and the verdict, exits 1 when they differ.
"""
import argparse
import json
import subprocess
import sys
import threading
from pathlib import Path

from strata_tools import NotReady, free_port, post_json, stop, wait_healthy


def layer_totals(profile: Path) -> dict[int, int]:
    out: dict[int, int] = {}
    for layer, _expert, hits in json.loads(profile.read_text())["ranked"]:
        out[layer] = out.get(layer, 0) + hits
    return out


def serve(cmd: list[str], np: int, prompts: list[tuple[str, int]], together: bool, out: Path) -> dict:
    profile = out / f"profile-np{np}.json"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    full = cmd + ["-np", str(np), "--expert-profile-out", str(profile), "--host", "127.0.0.1", "--port", str(port)]
    with open(out / f"server-np{np}.log", "wb") as log:
        proc = subprocess.Popen(full, stdout=subprocess.DEVNULL, stderr=log)
        try:
            wait_healthy(url, proc, poll=0.5)
        except NotReady as e:
            raise SystemExit(f"counts: {cmd[0]} {e}; see {out / f'server-np{np}.log'}")
        answers: list[dict | None] = [None] * len(prompts)

        def ask(i: int) -> None:
            text, n = prompts[i]
            answers[i] = post_json(url + "/completion", {"prompt": text, "n_predict": n, "temperature": 0,
                                                         "cache_prompt": False, "ignore_eos": True})

        try:
            if together:
                threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
            else:
                for i in range(len(prompts)):
                    ask(i)
        finally:
            stop(proc)
    return {"np": np, "together": together, "tokens": [(a or {}).get("tokens_evaluated", 0) + (a or {}).get("tokens_predicted", 0) for a in answers],
            "per_layer": layer_totals(profile)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--prompt-file", required=True)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--n", type=int, default=32)
    args, rest = ap.parse_known_args()
    cmd = [a for a in rest if a != "--"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    text = Path(args.prompt_file).read_text(errors="replace")
    # prompts of different lengths and lengths of answer, so that slots start and end apart
    prompts = [(text[: 200 + 700 * i], args.n // (1 + i % 2) + 3 * i) for i in range(args.k)]
    alone = serve(cmd, 1, prompts, False, out)
    print(f"counts: -np 1, one at a time: {alone['per_layer']}", flush=True)
    together = serve(cmd, args.k, prompts, True, out)
    print(f"counts: -np {args.k}, together: {together['per_layer']}", flush=True)
    ok = alone["per_layer"] == together["per_layer"] and bool(alone["per_layer"])
    (out / "counts.json").write_text(json.dumps({"command": cmd, "alone": alone, "together": together, "pass": ok}, indent=1))
    print(f"counts: {'pass' if ok else 'FAIL'}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
