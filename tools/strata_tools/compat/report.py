"""Merges two JUnit XML reports of the pin's server tests into bench/results/compat/latest.md."""

import argparse
import datetime
import platform
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

from strata_tools import REPO, provenance

ORDER = ["passed", "failed", "error", "skipped"]


def results(path):
    out = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        test_id = f'{case.get("classname", "")}::{case.get("name", "")}'
        status, reason = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                status = {"failure": "failed"}.get(child.tag, child.tag)
                reason = (child.get("message") or "").splitlines()[0][:120] if child.get("message") else ""
                break
        out[test_id] = (status, reason)
    return out


def binary_line(b: dict) -> str:
    """`path` (from the repository's root where it is inside), its --version line, its commit
    (strata-server) and sha256, in one Markdown line."""
    path = Path(b["path"])
    path = path.relative_to(REPO) if path.is_relative_to(REPO) else path
    if "error" in b:
        return f"`{path}` ({b['error']})"
    commit = f", commit `{b['commit']}`" if b.get("commit") else ""
    return f"`{path}`: `{b['version']}`{commit}, sha256 `{b['sha256']}`"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("upstream")
    ap.add_argument("strata")
    ap.add_argument("--command", default="tools/compat/run")
    ap.add_argument("--upstream-binary", help="the llama-server the upstream run used (its sha256 and --version go in)")
    ap.add_argument("--strata-binary", help="the strata-server the strata run used (its commit, sha256 and --version go in)")
    ap.add_argument("--retry", help="JUnit XML of a second strata-server run of the first run's regressions")
    ap.add_argument("--regressions", help="write the ids of upstream passes strata-server failed, one per line")
    ap.add_argument("--check", action="store_true", help="exit 1 if any upstream pass is not a strata-server pass")
    ap.add_argument("--known-gaps", help="file of test ids (with a reason after ' # ') that --check tolerates")
    a = ap.parse_args()
    up, st = results(a.upstream), results(a.strata)
    retried = set()
    if a.retry:
        for i, (status, reason) in results(a.retry).items():
            if i in st and st[i][0] != "passed":
                retried.add(i)
                st[i] = (status, reason if status != "passed" else "")
    ids = sorted(set(up) | set(st))
    missing = ("not run", "")
    cu = Counter(up.get(i, missing)[0] for i in ids)
    cs = Counter(st.get(i, missing)[0] for i in ids)
    regressions = [i for i in ids if up.get(i, missing)[0] == "passed" and st.get(i, missing)[0] != "passed"]

    print("# Compatibility: the pin's `tools/server/tests` against both servers\n")
    print(f"- command: `{a.command}`")
    for name, path in (("upstream llama-server", a.upstream_binary), ("strata-server", a.strata_binary)):
        if path:
            print(f"- {name}: {binary_line(provenance.binary(path))}")
    print(f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; host: {platform.machine()} {platform.node()}")
    print("- models: the presets are mapped to local files by `tools/strata_tools/compat/plugin.py`;")
    print("  a test that would download anything is skipped with `needs network`.\n")
    print("| result | upstream llama-server | strata-server |\n|---|---|---|")
    for k in ORDER + ["not run"]:
        if cu[k] or cs[k]:
            print(f"| {k} | {cu[k]} | {cs[k]} |")
    print(f"| total | {len(ids)} | {len(ids)} |\n")
    gaps = {}
    if a.known_gaps:
        for line in open(a.known_gaps):
            line = line.strip()
            if line and not line.startswith("#"):
                test_id, _, why = line.partition(" # ")
                gaps[test_id.strip()] = why.strip()
    print(f"Upstream passes that strata-server does not: **{len(regressions)}**\n")
    listed = [i for i in regressions if i in gaps]
    if listed:
        print("Known gaps (tools/compat/known-gaps.txt), tolerated by `--check`:\n")
        for i in listed:
            print(f"- `{i}`: {gaps[i]}")
        print()
    if retried:
        passed_on_retry = sorted(i for i in retried if st[i][0] == "passed")
        print(f"Retried once after a failure: {len(retried)}; passed on the retry: {len(passed_on_retry)}"
              + "".join(f"\n- `{i}`" for i in passed_on_retry) + "\n")
    print("| test | upstream | strata | strata's reason |\n|---|---|---|---|")
    for i in ids:
        u, s = up.get(i, missing), st.get(i, missing)
        reason = s[1].replace("|", "\\|") if s[0] != "passed" else ""
        shown = i.replace("|", "\\|")
        print(f"| `{shown}` | {u[0]} | {s[0]} | {reason} |")
    if a.regressions:
        with open(a.regressions, "w") as f:
            f.writelines(i + "\n" for i in regressions)
    if a.check:
        import sys
        unexpected = [i for i in regressions if i not in gaps]
        stale = [i for i in gaps if st.get(i, missing)[0] == "passed"]
        for i in stale:
            print(f"compat: known gap now passes, drop it from the list: {i}", file=sys.stderr)
        if unexpected:
            print(f"compat: {len(unexpected)} upstream passes fail on strata-server:", file=sys.stderr)
            for i in unexpected:
                print(f"  {i}", file=sys.stderr)
            sys.exit(1)


if __name__ == "__main__":
    main()
