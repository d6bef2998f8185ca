"""Long-context rows: each server command in turn, fresh prompts of increasing depth, each sent
without the prompt cache; the server's own prefill and decode speeds at each depth and the card's
memory in use while it serves (nvidia-smi; none without a GPU).

  depth --corpus FILE [--depths 8192,32768,131072,262144] [--n 128] --out DIR -- LABEL CMD ARGS... --- LABEL CMD ARGS...

The corpus is tokenized once per server (/tokenize) and repeated as needed; the request at depth D
sends its first D tokens, so every depth and every arm reads the same text. A depth that would not
leave room for the N generated tokens in a slot's context (/props) is cut to fit it. Each arm's rows go to
DIR/depth.json (with its binary's sha256 and --version line) as they come, so a cut run keeps
what it measured; the server's log is DIR/LABEL.log."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from strata_tools import provenance
from strata_tools.bench import prompt_ids
from strata_tools.bench.ab import card_used_mib
from strata_tools.bench.probe import arms_of
from strata_tools.device import parity

DEFAULT_DEPTHS = "8192,32768,131072,262144"


def fitted(depth: int, n_ctx: int | None, n: int) -> int:
    """The depth cut so that it and the n generated tokens fit a slot's context of n_ctx."""
    return depth if not n_ctx else min(depth, n_ctx - n)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        raise SystemExit(__doc__)
    cut = argv.index("--")
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--corpus", required=True)
    ap.add_argument("--depths", default=DEFAULT_DEPTHS, help=f"prompt lengths in tokens (default {DEFAULT_DEPTHS})")
    ap.add_argument("--n", type=int, default=128, help="tokens generated at each depth")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv[:cut])
    depths = [int(d) for d in a.depths.split(",") if d]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    text = Path(a.corpus).read_text(errors="replace")
    results = []
    for label, cmd in arms_of(argv[cut + 1:], "depth"):
        arm = {"label": label, "cmd": cmd, "binary": provenance.binary(provenance.command_binary(cmd)), "rows": []}
        results.append(arm)
        with parity.Server(cmd, out / f"{label}.log") as s:
            tokens = s.post("/tokenize", {"content": text, "add_special": False})["tokens"]
            s.post("/completion", {"prompt": tokens[:200], "n_predict": 8, "cache_prompt": False})
            n_ctx = s.get("/props").get("default_generation_settings", {}).get("n_ctx")
            arm["n_ctx"] = n_ctx
            for d in depths:
                r = s.post("/completion", {"prompt": prompt_ids(tokens, fitted(d, n_ctx, a.n)), "n_predict": a.n, "cache_prompt": False,
                                           "ignore_eos": True, "temperature": 0})
                t = r["timings"]
                row = {"prompt_tokens": t["prompt_n"], "prefill_tps": t["prompt_per_second"], "predicted_n": t["predicted_n"],
                       "decode_tps": t["predicted_per_second"], "card_used_mib": card_used_mib()}
                arm["rows"].append(row)
                print(f"{label:12s} depth {row['prompt_tokens']:7d}  prefill {row['prefill_tps']:8.1f} t/s  "
                      f"decode {row['predicted_n']:4d} at {row['decode_tps']:6.1f} t/s  card {row['card_used_mib']} MiB", flush=True)
                (out / "depth.json").write_text(json.dumps(results, indent=1))
        (out / "depth.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
