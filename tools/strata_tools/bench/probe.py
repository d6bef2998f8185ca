"""Prefill and decode speed of one request on each of several server commands, in turn: a check
that fits a short device call. tools/bench/ab is the benchmark; this is not a substitute.

  probe --prompt-file P [--n 128] --out DIR -- LABEL CMD ARGS... --- LABEL CMD ARGS...

Each server gets a short warm-up request, then the prompt without the prompt cache; the server's
own timings (prompt and predicted tokens per second) go to DIR/probe.json, with each binary's sha256
and --version line, and stdout."""
import argparse
import json
import sys
from pathlib import Path

from strata_tools import provenance
from strata_tools.device import parity


def arms_of(argv: list[str], tool: str) -> list[tuple[str, list[str]]]:
    """LABEL CMD ARGS... --- LABEL CMD ARGS... as (label, command) pairs."""
    arms, cur = [], []
    for tok in argv + ["---"]:
        if tok == "---":
            if len(cur) < 2:
                raise SystemExit(f"{tool}: each arm needs a label and a command")
            arms.append((cur[0], cur[1:]))
            cur = []
        else:
            cur.append(tok)
    return arms


def main() -> None:
    argv = sys.argv[1:]
    if "--" not in argv:
        raise SystemExit(__doc__)
    cut = argv.index("--")
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--prompt-file", required=True)
    ap.add_argument("--n", type=int, default=128)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv[:cut])
    arms = arms_of(argv[cut + 1:], "probe")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    prompt = Path(a.prompt_file).read_text()
    results = []
    for label, cmd in arms:
        with parity.Server(cmd, out / f"{label}.log") as s:
            s.post("/completion", {"prompt": prompt[:200], "n_predict": 8, "cache_prompt": False})
            r = s.post("/completion", {"prompt": prompt, "n_predict": a.n, "cache_prompt": False, "ignore_eos": True, "temperature": 0})
        t = r["timings"]
        row = {"label": label, "cmd": cmd, "binary": provenance.binary(provenance.command_binary(cmd)), "prompt_n": t["prompt_n"], "prefill_tps": t["prompt_per_second"],
               "predicted_n": t["predicted_n"], "decode_tps": t["predicted_per_second"]}
        print(f"{label:12s} prompt {row['prompt_n']:6d}  prefill {row['prefill_tps']:8.1f} t/s  "
              f"decode {row['predicted_n']:4d} at {row['decode_tps']:6.1f} t/s", flush=True)
        results.append(row)
        (out / "probe.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
