"""Ratios between rows of this run (fresh requests in execution order, candidate = the seed's
line): MTP drafting at each acceptance against the same tiers without --spec, PLE on SSD against
PLE in RAM, and the seed's line at -ub 4096.
    python3 ratios.py"""
import json
import statistics


def fresh(path):
    return [r for r in json.load(open(path))["requests"] if r["kind"] == "fresh"]


def show(name, a, b, key="decode_tps"):
    r = [x[key] / y[key] for x, y in zip(a, b)]
    print(f"{name}: {', '.join(f'{x:.3f}' for x in r)} (median {statistics.median(r):.3f})")


nospec = fresh("call2-rows/row-24-0-8192-a0.9/candidate.json")
nospec4096 = fresh("call4-accept0/row-24-0-4096-a0/candidate.json")
for acc, row, base, base_name in (
    ("0.9", "call2-rows/row-24-4-8192-a0.9", nospec, "call 2"),
    ("0.5", "call5-accept0.5/row-24-4-8192-a0.5", nospec, "call 2"),
    ("0", "call4-accept0/row-24-4-8192-a0", nospec4096, "call 4, -ub 4096"),
):
    show(f"decode, --spec 4 at acceptance {acc} / without --spec ({base_name})", fresh(f"{row}/candidate.json"), base)
ram = fresh("call2-rows/row-24-0-8192-ram-a0.9/candidate.json")
show("decode, PLE on SSD / PLE in RAM", nospec, ram)
show("prefill, PLE on SSD / PLE in RAM", nospec, ram, "prefill_tps")
show("prefill, -ub 4096 / --prefill 8192 (the seed's line; both fitted to -ub 1024)", nospec4096, nospec, "prefill_tps")
ceil4096 = fresh("call3-accept0-failed/row-24-0-4096-a0/ceiling.json")
show("prefill, -ub 4096 row / all-GPU -ub 4096 (call 3, same machine)", nospec4096, ceil4096, "prefill_tps")
show("decode, -ub 4096 row / all-GPU -ub 4096 (call 3, same machine)", nospec4096, ceil4096)
