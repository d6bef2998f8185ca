"""The --spec 4 row of call 2 against the all-GPU ceiling with the same drafting, which call 1
measured on the same warm machine before its deadline cut the row: fresh requests in order.
    python3 spec-ceiling.py"""
import json
import statistics

def fresh(path):
    return [r for r in json.load(open(path))["requests"] if r["kind"] == "fresh"]

ceil = fresh("call1-build-profile/row-24-4-8192-a0.9-cut/ceiling.json")
cand = fresh("call2-rows/row-24-4-8192-a0.9/candidate.json")
nospec = fresh("call2-rows/row-24-0-8192-a0.9/candidate.json")
nospec_ceil = fresh("call2-rows/row-24-0-8192-a0.9/ceiling.json")
for key in ("prefill_tps", "decode_tps"):
    r = [c[key] / e[key] for c, e in zip(cand, ceil)]
    print(f"{key}: strata --spec 4 at 24 GiB / all-GPU --spec-type draft-mtp: {', '.join(f'{x:.3f}' for x in r)} (median {statistics.median(r):.3f})")
for name, a, b in (("strata at 24 GiB", cand, nospec), ("all-GPU", ceil, nospec_ceil)):
    r = [x["decode_tps"] / y["decode_tps"] for x, y in zip(a, b)]
    print(f"decode with MTP drafting / without, {name}: {', '.join(f'{x:.3f}' for x in r)} (median {statistics.median(r):.3f})")
