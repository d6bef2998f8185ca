"""tools/device/ptx_loads.py: a patched kernel whose weight loads left the read-only or global
path is found from the PTX of both files (no nvcc here: the PTX below is written by hand)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parents[2] / "tools" / "device" / "ptx_loads.py"


def kernel(name: str, *loads: str) -> str:
    body = "\n".join(f"\t{op} \t%rs{i}, [%rd{i}];" for i, op in enumerate(loads))
    return f".visible .entry {name}(\n\t.param .u64 {name}_param_0\n)\n{{\n{body}\n\tret;\n}}\n"


def run(tmp_path: Path, pristine: str, patched: str) -> subprocess.CompletedProcess:
    (tmp_path / "a.ptx").write_text(pristine)
    (tmp_path / "b.ptx").write_text(patched)
    return subprocess.run([sys.executable, TOOL, tmp_path / "a.ptx", tmp_path / "b.ptx"],
                          capture_output=True, text=True)


PRISTINE = kernel("_Z3mmvq", "ld.global.nc.u16", "ld.global.nc.u16", "ld.global.u32") + kernel("_Z4norm", "ld.global.f32")


def test_generic_loads_where_the_pristine_read_only_ones_were_are_a_loss(tmp_path):
    patched = kernel("_Z3mmvq", "ld.u16", "ld.u16", "ld.global.u32") + kernel("_Z4norm", "ld.global.f32")
    r = run(tmp_path, PRISTINE, patched)
    assert r.returncode == 1
    assert "_Z3mmvq: u16 loads, read-only/global 2/2 in the pristine, 0/0 patched" in r.stdout
    assert "_Z4norm" not in r.stdout


def test_global_loads_are_still_a_loss_of_the_read_only_path(tmp_path):
    patched = kernel("_Z3mmvq", "ld.global.u16", "ld.global.u16", "ld.global.u32") + kernel("_Z4norm", "ld.global.f32")
    r = run(tmp_path, PRISTINE, patched)
    assert r.returncode == 1 and "read-only/global 2/2 in the pristine, 0/2 patched" in r.stdout


def test_a_second_copy_of_the_loop_and_read_only_loads_the_pristine_lacked_pass(tmp_path):
    patched = kernel("_Z3mmvq", "ld.global.nc.u16", "ld.global.nc.u16", "ld.global.u16", "ld.u16",
                     "ld.global.nc.u32") + kernel("_Z4norm", "ld.global.f32") + kernel("_Z5extra", "ld.u8")
    r = run(tmp_path, PRISTINE, patched)
    assert r.returncode == 0, r.stdout
    assert "2 kernels compared, 0 lost loads" in r.stdout


def test_vector_loads_and_cache_hints_are_told_apart_by_shape_not_by_hint(tmp_path):
    pristine = kernel("_Z3mmvq", "ld.global.nc.L1::no_allocate.v4.u32", "ld.global.nc.u32")
    same = kernel("_Z3mmvq", "ld.global.nc.v4.u32", "ld.global.nc.u32")
    lost = kernel("_Z3mmvq", "ld.v4.u32", "ld.global.nc.u32", "ld.global.nc.u32")
    assert run(tmp_path, pristine, same).returncode == 0
    r = run(tmp_path, pristine, lost)
    assert r.returncode == 1 and "v4.u32 loads" in r.stdout
