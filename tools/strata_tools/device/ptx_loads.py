"""Checks that no kernel of a patched CUDA file lost the read-only (ld.global.nc) or global loads
the same kernel has in the pristine file, by the PTX of both: a patch that reads the weights
through a pointer the compiler cannot trace costs every decode step (3-4% on the H100).

    tools/device/ptx_loads.py PRISTINE.ptx PATCHED.ptx    (tools/device/compile-check runs it)

Exit status 1, with each kernel and load kind that lost instructions, if any did."""

from __future__ import annotations

import re
import sys
from collections import Counter

LOAD = re.compile(r"^\s+ld\.global\.(\S+)\s", re.M)


def kind(qualifiers: str) -> str:
    """ld.global.nc.L1::no_allocate.v4.u32 -> "nc.v4.u32": the path and the shape, no cache hints."""
    parts = qualifiers.split(".")
    shape = [p for p in parts if re.fullmatch(r"v\d|[usbf]\d+", p)]
    return ".".join((["nc"] if "nc" in parts else ["global"]) + shape)


def kernels(path: str) -> dict[str, Counter]:
    text = open(path).read()
    out = {}
    starts = [m for m in re.finditer(r"^\.(?:visible )?\.?entry (\S+)\(", text, re.M)]
    for i, m in enumerate(starts):
        end = starts[i + 1].start() if i + 1 < len(starts) else len(text)
        out[m.group(1)] = Counter(kind(q) for q in LOAD.findall(text[m.start():end]))
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    pristine, patched = kernels(argv[0]), kernels(argv[1])
    lost = []
    for name, want in pristine.items():
        have = patched.get(name)
        if have is None:
            continue
        # Per width: no fewer read-only loads, and no fewer global ones (read-only counting as global).
        for width in sorted({k.split(".", 1)[1] for k in want}):
            nc = lambda c: c[f"nc.{width}"]  # noqa: E731
            glob = lambda c: c[f"global.{width}"] + nc(c)  # noqa: E731
            if nc(have) < nc(want) or glob(have) < glob(want):
                lost.append(f"{name}: {width} loads, read-only/global {nc(want)}/{glob(want)} in the pristine, "
                            f"{nc(have)}/{glob(have)} patched")
    for line in lost:
        print(line)
    print(f"ptx_loads: {len(pristine)} kernels compared, {len(lost)} lost loads")
    return 1 if lost else 0


if __name__ == "__main__":
    sys.exit(main())
