"""Results name the binary they measured from the binary itself: its sha256, the first line of its
--version, and strata-server's commit from that line."""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

import pytest

from strata_tools import provenance

REPO = Path(__file__).resolve().parents[2]
STRATA = Path(os.environ.get("STRATA_SERVER", REPO / "target" / "release" / "strata-server"))
UPSTREAM = Path(os.environ.get("STRATA_UPSTREAM_SERVER", REPO / "target" / "upstream" / "bin" / "llama-server"))


def fake(tmp_path: Path, first_line: str) -> Path:
    """A server that prints its version on stderr, as both servers do."""
    p = tmp_path / "server"
    p.write_text(f"#!/bin/sh\necho '{first_line}' >&2\necho 'built with a compiler' >&2\n")
    p.chmod(0o755)
    return p


def test_strata_servers_commit_comes_from_its_version_line(tmp_path: Path) -> None:
    p = fake(tmp_path, "strata-server 0.1.0 (commit 0123456789ab)")
    b = provenance.binary(p)
    assert b == {"path": str(p), "sha256": hashlib.sha256(p.read_bytes()).hexdigest(),
                 "version": "strata-server 0.1.0 (commit 0123456789ab)", "commit": "0123456789ab"}


def test_a_strata_server_without_a_commit_says_so_and_llama_server_has_none(tmp_path: Path) -> None:
    assert provenance.binary(fake(tmp_path, "strata-server 0.1.0"))["commit"] is None
    up = provenance.binary(fake(tmp_path, "version: 0.6.0-dev (build 11434, commit unknown)"))
    assert up["version"] == "version: 0.6.0-dev (build 11434, commit unknown)" and "commit" not in up


def test_a_missing_binary_is_an_error_not_a_guess(tmp_path: Path) -> None:
    b = provenance.binary(tmp_path / "nope")
    assert set(b) == {"path", "error"}


def test_the_program_of_a_command_is_found_past_env() -> None:
    assert provenance.command_binary(["env", "A=1", "B=2", "/bin/srv", "-m", "x"]) == "/bin/srv"
    assert provenance.command_binary(["/bin/srv", "A=1"]) == "/bin/srv"


@pytest.mark.skipif(not (STRATA.exists() and UPSTREAM.exists()), reason="needs tools/setup and tools/build-upstream")
def test_the_real_servers() -> None:
    s = provenance.binary(STRATA)
    assert re.fullmatch(r"strata-server \S+ \(commit [0-9a-f]{12}\)", s["version"]) and s["commit"] in s["version"]
    u = provenance.binary(UPSTREAM)
    assert u["version"].startswith("version: ") and len(u["sha256"]) == 64 and "commit" not in u
