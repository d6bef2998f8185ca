"""Writes a ranked expert profile for an MoE model: runs strata-server over a corpus with
--expert-profile-out, so every (layer, expert) is ranked by how often routing selected it.

    tools/expert-profile --model M.gguf --corpus DIR_OR_FILE... --out PROFILE.json [options] [-- server args]
    tools/expert-profile --reverse PROFILE.json --out STALE.json

Each corpus file (or each file under a directory, sorted) is sent once to /completion, cut to
--max-chars, with --n-predict greedy tokens; the prompt and the generated tokens are both counted.
Arguments after `--` go to strata-server as they are (e.g. `-- -c 8192 -ngl 99 --cpu-moe`). The
profile format is docs/expert-profile.md; strata-server reads it with --expert-profile.

The server writes the profile beside --out under a temporary name, renamed to --out once it is
complete: a failed run leaves --out as it was. Every failure is one line on stderr and a
non-zero exit.

With --reverse it writes a stale profile for benchmarks: each layer's ranking reversed (its
most-selected expert gets the fewest selections), a workload whose routing has moved away from
the profile's.
"""
import argparse
import http.client
import json
import os
import subprocess
import sys
import time
import urllib.error
from pathlib import Path

from strata_tools import REPO, NotReady, free_port, http_error_message, post_json, stop, wait_healthy, write_atomic

TITLE, USAGE, DESCRIPTION = __doc__.split("\n\n", 2)


class Failure(SystemExit):
    """One line on stderr, exit status 1."""

    def __init__(self, message: str):
        super().__init__(f"expert-profile: {message}")


def corpus_files(items: list[str]) -> list[Path]:
    files: list[Path] = []
    for item in items:
        p = Path(item)
        if p.is_dir():
            files += sorted(f for f in p.rglob("*") if f.is_file())
        elif p.is_file():
            files.append(p)
        else:
            raise Failure(f"no such corpus file or directory: {item}")
    if not files:
        raise Failure("the corpus is empty")
    return files


def writable_file(path: Path, what: str) -> Path:
    """path, resolved, once its folder exists and it is not itself a folder."""
    path = path.resolve()
    if not path.parent.is_dir():
        raise Failure(f"the folder of {what} does not exist: {path.parent}")
    if path.is_dir():
        raise Failure(f"{what} is a folder: {path}")
    return path


def last_line(path: Path) -> str:
    try:
        lines = [ln.strip() for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return lines[-1] if lines else ""


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


def reverse_file(src: str, out: str) -> int:
    dest = writable_file(Path(out), "--out")
    try:
        prof = json.loads(Path(src).read_text())
        stale = reverse(prof)
    except OSError as e:
        raise Failure(f"cannot read {src}: {e.strerror or e}")
    except (ValueError, KeyError, TypeError, IndexError):
        raise Failure(f"{src} is not an expert profile (docs/expert-profile.md)")
    write_atomic(dest, json.dumps(stale, indent=1) + "\n")
    print(f"expert-profile: {out}: {src} with each layer's ranking reversed")
    return 0


def profile(args, extra: list[str]) -> int:
    out = writable_file(Path(args.out), "--out")
    log_path = writable_file(Path(args.log) if args.log else out.with_name(out.name + ".log"), "--log")
    if not Path(args.model).is_file():
        raise Failure(f"no such model file: {args.model}")
    if not (Path(args.server).is_file() and os.access(args.server, os.X_OK)):
        raise Failure(f"no strata-server at {args.server} (build it with tools/setup, or give --server)")
    files = corpus_files(args.corpus)
    partial = out.with_name(f".{out.name}.{os.getpid()}.partial")
    port = free_port()
    cmd = [args.server, "-m", args.model, "--host", "127.0.0.1", "--port", str(port), "-np", "1",
           "--expert-profile-out", str(partial)] + extra
    print("expert-profile: " + " ".join(cmd), flush=True)
    try:
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log)
            try:
                url = f"http://127.0.0.1:{port}"
                try:
                    wait_healthy(url, proc)
                except NotReady as e:
                    why = last_line(log_path)
                    raise Failure(f"strata-server {e}{': ' + why if why else ''}; see {log_path}")
                t0 = time.time()
                n_tokens = 0
                for i, f in enumerate(files):
                    text = f.read_text(errors="replace")[: args.max_chars]
                    try:
                        r = post_json(url + "/completion", {"prompt": text, "n_predict": args.n_predict, "temperature": 0,
                                                            "cache_prompt": False})
                    except urllib.error.HTTPError as e:
                        raise Failure(f"{f}: strata-server answered {e.code}: {http_error_message(e)}")
                    except (OSError, ValueError, http.client.HTTPException) as e:
                        raise Failure(f"{f}: no answer from strata-server ({e}); see {log_path}")
                    n_tokens += r["tokens_evaluated"] + r["tokens_predicted"]
                    print(f"  [{i + 1}/{len(files)}] {f}: {r['tokens_evaluated']} + {r['tokens_predicted']} tokens", flush=True)
            finally:
                stop(proc)
        if not partial.exists():
            raise Failure(f"the server wrote no profile; see {log_path}")
        try:
            hits = [e[2] for e in json.loads(partial.read_text())["ranked"]]
        except (ValueError, KeyError, TypeError, IndexError):
            raise Failure(f"the server's profile is not one (docs/expert-profile.md); see {log_path}")
        os.replace(partial, out)
    finally:
        partial.unlink(missing_ok=True)
    total = sum(hits) or 1
    tenth = max(1, len(hits) // 10)
    print(f"expert-profile: {out}: {len(files)} files, {n_tokens} tokens in {time.time() - t0:.1f} s; "
          f"{len(hits)} experts ranked; the top 10% take {100 * sum(hits[:tenth]) / total:.1f}% of selections")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    own, extra = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    ap = argparse.ArgumentParser(prog="expert-profile", usage="\n       ".join(ln.strip() for ln in USAGE.splitlines()),
                                 description=TITLE + "\n\n" + DESCRIPTION,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="the MoE model (GGUF)")
    ap.add_argument("--corpus", nargs="+", help="text files or directories")
    ap.add_argument("--reverse", metavar="PROFILE", help="write PROFILE with each layer's ranking reversed to --out")
    ap.add_argument("--out", required=True, help="the profile to write (its folder must exist)")
    ap.add_argument("--server", default=str(REPO / "target/release/strata-server"), help="strata-server (default: the release build)")
    ap.add_argument("--max-chars", type=int, default=16000, help="characters of each file sent (default 16000)")
    ap.add_argument("--n-predict", type=int, default=32, help="greedy tokens generated after each file (default 32)")
    ap.add_argument("--log", help="server log file (default: OUT.log)")
    args = ap.parse_args(own)
    try:
        if args.reverse:
            return reverse_file(args.reverse, args.out)
        if not (args.model and args.corpus):
            ap.error("a profile run needs --model and --corpus")
        return profile(args, extra)
    except OSError as e:
        raise Failure(f"{e.filename or ''}: {e.strerror or e}" if e.filename else str(e))
    except KeyboardInterrupt:
        raise Failure("interrupted; --out is left as it was")


if __name__ == "__main__":
    sys.exit(main())
