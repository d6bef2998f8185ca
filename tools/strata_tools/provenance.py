"""Where a result's numbers came from, read from the server binary itself, never typed by hand:
the file's sha256 and the first line of its `--version`; for strata-server also the commit that
line names (`strata-server 0.1.0 (commit 0123456789ab)`)."""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
from pathlib import Path

STRATA_VERSION = re.compile(r"strata-server \S+ \(commit ([0-9a-f]{12})\)")
VERSION_TIMEOUT_S = 120


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def version_line(path: Path) -> str:
    """The first non-empty line `path --version` prints (llama-server and strata-server both
    print it on stderr)."""
    res = subprocess.run([str(path), "--version"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         errors="replace", timeout=VERSION_TIMEOUT_S)
    return next((line.strip() for line in res.stdout.splitlines() if line.strip()), "")


def binary(path) -> dict:
    """{"path", "sha256", "version"} of a server binary (a bare name is looked up on PATH), and
    "commit" where the version line is strata-server's (None if it names none). A binary that
    cannot be read or run gets "error" instead of what could not be found out."""
    p = Path(shutil.which(str(path)) or path)
    out: dict = {"path": str(p)}
    try:
        out["sha256"] = sha256(p)
        out["version"] = version_line(p)
    except (OSError, subprocess.SubprocessError) as e:
        return out | {"error": f"{type(e).__name__}: {e}"}
    if out["version"].startswith("strata-server"):
        m = STRATA_VERSION.match(out["version"])
        out["commit"] = m.group(1) if m else None
    return out


def command_binary(cmd: list[str]) -> str:
    """The program of a server command line, past an `env VAR=VALUE ...` prefix."""
    i = 0
    if cmd[:1] == ["env"]:
        i = 1
        while i < len(cmd) and "=" in cmd[i] and not cmd[i].startswith("-"):
            i += 1
    return cmd[i] if i < len(cmd) else ""
