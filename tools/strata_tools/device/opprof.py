"""Where a prompt batch's time goes, per op, in two or more server arms (no timeline profiler runs
on the GPU machine). Each arm is one strata-server command line; it is started twice on the same
prompt: once plain (the real prompt speed from the server's timings) and once with
STRATA_OP_PROFILE (every node computed and synchronised on its own, so fusion is off; compare the
arms' profiles with each other, not with the plain speed).

    tools/device/opprof --out DIR --prompt-file F [--tokens 4096] [--profile-only] -- NAME=CMD... --- NAME=CMD...
    tools/device/opprof --summary DIR          # the table of an earlier run

Writes DIR/NAME.plain.json, DIR/NAME.ops.jsonl, DIR/NAME.*.log and DIR/summary.txt: per arm the
prompt t/s, then per op (op and tensor name without its layer) the ms per batch of each arm.
"""
import argparse
import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

from strata_tools import NotReady, free_port, post_json, provenance, split_arms, stop, wait_healthy


def run_arm(name: str, cmd: list[str], text: str, n_tokens: int, out: Path, profile: bool) -> dict:
    port = free_port()
    env = dict(os.environ)
    kind = "ops" if profile else "plain"
    if profile:
        env["STRATA_OP_PROFILE"] = str(out / f"{name}.ops.jsonl")
    with open(out / f"{name}.{kind}.log", "wb") as log:
        proc = subprocess.Popen(cmd + ["--host", "127.0.0.1", "--port", str(port)], stdout=subprocess.DEVNULL, stderr=log, env=env)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_healthy(url, proc, poll=0.5)
            prompt = post_json(url + "/tokenize", {"content": text})["tokens"]
            prompt = (prompt * (n_tokens // max(len(prompt), 1) + 1))[:n_tokens]
            post_json(url + "/completion", {"prompt": prompt[:64], "n_predict": 1, "cache_prompt": False})
            runs = [post_json(url + "/completion", {"prompt": prompt, "n_predict": 1, "cache_prompt": False})["timings"] for _ in range(2)]
        except NotReady as e:
            raise SystemExit(f"opprof: {name}: {e}; see {out / f'{name}.{kind}.log'}")
        finally:
            stop(proc)
    return {"prompt_n": runs[-1]["prompt_n"], "prompt_per_second": [r["prompt_per_second"] for r in runs],
            "binary": provenance.binary(provenance.command_binary(cmd))}


def load_ops(path: Path) -> tuple[dict, float, int]:
    """ms per batch by (op, name), averaged over the batches of the last request; and the
    batch's decode ms."""
    lines = [json.loads(s) for s in path.read_text().splitlines() if s.strip()]
    big = max(x["tokens"] for x in lines)
    last = [x for x in lines if x["tokens"] == big][-1:]
    ops: dict = defaultdict(float)
    for b in last:
        for o in b["ops"]:
            ops[(o["op"], o["name"])] += o["us"] / 1e3 / len(last)
    return ops, sum(b["decode_us"] for b in last) / 1e3 / len(last), big


def summary(out: Path) -> str:
    arms = json.loads((out / "arms.json").read_text())
    rows = [f"{'arm':<12} prompt tokens  plain prompt t/s   profiled batch ms (tokens)"]
    profiles = {}
    for name in arms:
        plain = json.loads((out / f"{name}.plain.json").read_text())
        ops, ms, big = load_ops(out / f"{name}.ops.jsonl")
        profiles[name] = ops
        tps = "/".join(f"{x:.0f}" for x in plain["prompt_per_second"]) + (" (profiled)" if plain.get("profiled") else "")
        rows.append(f"{name:<12} {plain['prompt_n']:>13}  {tps:>16}   {ms:.1f} ({big})")
    keys = sorted({k for p in profiles.values() for k in p}, key=lambda k: -max(p.get(k, 0) for p in profiles.values()))
    rows.append("")
    rows.append(f"{'op':<14} {'tensor':<28} " + " ".join(f"{n:>12}" for n in arms) + "   (ms per batch)")
    for k in keys[:40]:
        rows.append(f"{k[0][:14]:<14} {k[1][:28]:<28} " + " ".join(f"{profiles[n].get(k, 0):>12.2f}" for n in arms))
    rows.append(f"{'sum':<14} {'':<28} " + " ".join(f"{sum(profiles[n].values()):>12.2f}" for n in arms))
    rows.append("")
    rows.append("expert matmuls per layer (ms, the batch of the last request): min / median / max, even / odd layers")
    for name in arms:
        per = mm_by_layer(out / f"{name}.ops.jsonl")
        if per:
            v = sorted(per.values())
            even = [ms for l, ms in per.items() if l % 2 == 0]
            odd = [ms for l, ms in per.items() if l % 2 == 1]
            mean = lambda x: sum(x) / len(x) if x else 0.0  # noqa: E731
            rows.append(f"{name:<12} {v[0]:.2f} / {v[len(v) // 2]:.2f} / {v[-1]:.2f}   even {mean(even):.2f} / odd {mean(odd):.2f}")
    return "\n".join(rows) + "\n"


def mm_by_layer(path: Path) -> dict[int, float]:
    """ms of the expert matmuls per layer in the largest batch of the last request."""
    lines = [json.loads(s) for s in path.read_text().splitlines() if s.strip()]
    big = max(x["tokens"] for x in lines)
    last = [x for x in lines if x["tokens"] == big][-1]
    per: dict[int, float] = defaultdict(float)
    for layer, _name, us in last.get("mul_mat_id_by_layer", []):
        per[layer] += us / 1e3
    return dict(per)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--prompt-file", type=Path)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--summary", type=Path)
    ap.add_argument("--profile-only", action="store_true", help="skip the plain run (the t/s column is then the profiled run's)")
    ap.add_argument("arms", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    if a.summary:
        sys.stdout.write(summary(a.summary))
        return
    args = a.arms[1:] if a.arms[:1] == ["--"] else a.arms
    arms = dict(split_arms(args, "opprof"))
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "arms.json").write_text(json.dumps(arms, indent=1))
    text = a.prompt_file.read_text()
    for name, cmd in arms.items():
        if not a.profile_only:
            (a.out / f"{name}.plain.json").write_text(json.dumps(run_arm(name, cmd, text, a.tokens, a.out, False)))
        timings = run_arm(name, cmd, text, a.tokens, a.out, True)
        if a.profile_only:
            (a.out / f"{name}.plain.json").write_text(json.dumps(timings | {"profiled": True}))
        print(f"opprof: {name} done", flush=True)
    text = summary(a.out)
    (a.out / "summary.txt").write_text(text)
    sys.stdout.write(text)


if __name__ == "__main__":
    main()
