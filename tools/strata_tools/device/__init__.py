"""The device tools behind the commands in tools/device/."""

from __future__ import annotations


def split_arms(argv: list[str], tool: str = "device") -> list[tuple[str, list[str]]]:
    """`NAME=BIN ARGS --- NAME=BIN ARGS` into (name, command) pairs, in order."""
    arms: list[tuple[str, list[str]]] = []
    cur: list[str] = []
    for a in argv + ["---"]:
        if a != "---":
            cur.append(a)
            continue
        if cur:
            name, _, first = cur[0].partition("=")
            if not name or not first:
                raise SystemExit(f"{tool}: an arm starts NAME=BIN, not {cur[0]!r}")
            arms.append((name, [first] + cur[1:]))
        cur = []
    return arms
