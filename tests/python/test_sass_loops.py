"""tools/device/sass_loops.py: the loops of a kernel's SASS, found by their backward branches,
each with its length and loads by kind (no cuobjdump here: the SASS below is written by hand in
its layout)."""

from __future__ import annotations

from strata_tools.device import sass_loops


def sass(*ins: str) -> str:
    lines = ["        Function : _Z3mmvq", "        .headerflags    @\"EF_CUDA_SM90\""]
    lines += [f"        /*{16 * i:04x}*/                   {t} ;                 /* 0x000fe200078e00ff */" for i, t in enumerate(ins)]
    return "\n".join(lines) + "\n"


def test_each_backward_branch_closes_a_loop_with_its_loads_counted():
    text = sass("MOV R1, c[0x0][0x28]",
                "LDG.E.CONSTANT R2, desc[UR4][R4.64]",          # 0x10: first loop
                "@P0 LDG.E.U16.CONSTANT R3, desc[UR4][R4.64+0x2]",
                "IMAD R5, R2, R3, R5",
                "@P1 BRA 0x10",
                "LD.E.U16 R6, desc[UR4][R8.64]",                # 0x50: second loop
                "LDG.E.U16 R7, desc[UR4][R8.64+0x2]",
                "@!P2 BRA 0x50",
                "BRA 0x90",                                      # a forward branch, no loop
                "EXIT")
    ins = sass_loops.parse(text)
    assert len(ins) == 10 and ins[1] == (0x10, "LDG.E.CONSTANT R2, desc[UR4][R4.64]")
    assert sass_loops.loops(ins) == [
        (0x10, 4, {"LDG.E.CONSTANT": 1, "LDG.E.U16.CONSTANT": 1}),
        (0x50, 3, {"LD.E.U16": 1, "LDG.E.U16": 1}),
    ]


def test_a_kernel_without_backward_branches_has_no_loops():
    assert sass_loops.loops(sass_loops.parse(sass("LDG.E R2, desc[UR4][R4.64]", "BRA 0x20", "EXIT"))) == []
