"""Fails when the modules of a crate import each other in a cycle.

A module is a source file (a folder's mod.rs is the folder). A file depends on another when it
names it by path: `crate::a::b`, `super::x`, `self::x` (in a use or inline). A dependency of a
module on its own parent (mod.rs) counts as well, so splitting one impl over files does not hide
a cycle; a parent declaring its children (`mod x;`) and re-exporting them (`pub use x::..`) does
not count. Usage: tools/check_modules.py CRATE_SRC... (default: every crate of the workspace).
"""

import re
import sys
from pathlib import Path

from strata_tools import REPO
PATH = re.compile(r"\b(crate|super|self)((?:::[A-Za-z_][A-Za-z_0-9]*)+)")
COMMENT = re.compile(r"//[^\n]*")
STRING = re.compile(r'"(?:[^"\\]|\\.)*"')


def module_of(src: Path, f: Path) -> tuple[str, ...]:
    parts = f.relative_to(src).with_suffix("").parts
    if parts[-1] in ("mod", "lib", "main"):
        parts = parts[:-1]
    return tuple(parts)


def uses(text: str) -> str:
    """The text with comments, strings and `#[cfg(test)] mod tests` removed."""
    i = text.find("#[cfg(test)]\nmod tests")
    if i >= 0:
        text = text[:i]
    text = STRING.sub('""', text)
    return COMMENT.sub("", text)


def graph(src: Path) -> dict[tuple[str, ...], set[tuple[str, ...]]]:
    files = sorted(src.rglob("*.rs"))
    modules = {module_of(src, f): f for f in files}
    edges: dict[tuple[str, ...], set[tuple[str, ...]]] = {m: set() for m in modules}
    for m, f in modules.items():
        text = uses(f.read_text())
        is_dir = f.name in ("mod.rs", "lib.rs", "main.rs")
        reexport = set()
        for line in text.splitlines():
            line = line.strip()
            if line.startswith("pub use ") or line.startswith("pub(crate) use "):
                reexport.add(line)
        for line_no, line in enumerate(text.splitlines()):
            if line.strip() in reexport:
                continue
            for root, rest in PATH.findall(line):
                names = rest.split("::")[1:]
                if root == "crate":
                    base: tuple[str, ...] = ()
                elif root == "self":
                    base = m
                else:
                    base = m[:-1]
                    while names and names[0] == "super":
                        base, names = base[:-1], names[1:]
                target = base
                for n in names:
                    if base + (n,) in modules or (target + (n,)) in modules:
                        target = target + (n,)
                    else:
                        break
                if target != m and target in modules and not (is_dir and target[: len(m)] == m and len(target) > len(m)):
                    edges[m].add(target)
    return edges


def cycles(edges: dict[tuple[str, ...], set[tuple[str, ...]]]) -> list[list[tuple[str, ...]]]:
    index: dict = {}
    low: dict = {}
    stack: list = []
    on: set = set()
    out = []
    counter = [0]

    def strong(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(edges):
        if v not in index:
            strong(v)
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    srcs = [Path(a) for a in argv] or [REPO / "server/src", REPO / "ffi/src", REPO / "residency/src"]
    bad = 0
    for src in srcs:
        for comp in cycles(graph(src)):
            bad += 1
            names = ["::".join(m) or "crate" for m in comp]
            print(f"{src.relative_to(REPO) if src.is_relative_to(REPO) else src}: modules that import each other in a cycle: {', '.join(names)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
