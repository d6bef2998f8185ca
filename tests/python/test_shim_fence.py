"""No C++ exception may cross from the shim into Rust (that aborts the process): every exported
function of the shim (ffi/shim/*.cpp) runs its body under guarded() or its own try/catch, except
the few listed here, which call nothing that throws."""

from __future__ import annotations

import re
from pathlib import Path

SHIM_DIR = Path(__file__).resolve().parents[2] / "ffi" / "shim"
HEADER = SHIM_DIR / "strata_shim.h"

# name -> why it cannot throw
CANNOT_THROW = {
    "strata_string_free": "std::free",
    "strata_stdio_flush": "fflush",
    "strata_params_free": "delete of an object whose destructor is noexcept",
    "strata_params_set_n_ubatch": "sets an int",
    "strata_chat_templates_free": "delete of an object whose destructor is noexcept",
    "strata_sampler_free": "common_sampler_free and delete, noexcept",
    "strata_speculative_free": "common_speculative_free and delete, noexcept",
    "strata_speculative_has_context": "reads a pointer",
    "strata_build_info": "returns a static string",
    "strata_bytes_data": "vector::data",
    "strata_bytes_size": "vector::size",
    "strata_bytes_free": "delete of a vector holder",
    "strata_reserve_stdout": "POSIX dup/dup2",
    "strata_last_error_kind": "reads a thread-local int",
    "strata_logits_argmax": "arithmetic and memcpy over the floats it is given",
    "strata_sampler_set_argmax": "sets a bool",
    "strata_sampler_argmax": "reads a bool",
    "strata_sampler_backend": "reads the sampler's settings",
    "strata_backend_samplers_free": "delete of a holder of samplers, noexcept",
}


def exported_bodies(text: str) -> dict[str, str]:
    out = {}
    for m in re.finditer(r"^(?!static)[A-Za-z_][\w \*]*?\b(strata_\w+)\(([^)]*)\)\s*\{", text, re.M):
        start = m.end()
        depth, i = 1, start
        while depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        out[m.group(1)] = text[start:i - 1]
    return out


def shim_bodies() -> dict[str, str]:
    out = {}
    for path in sorted(SHIM_DIR.glob("*.cpp")):
        bodies = exported_bodies(path.read_text())
        assert not set(bodies) & set(out), f"{path.name} defines a function another part defines"
        out.update(bodies)
    return out


def test_every_exported_function_catches_or_cannot_throw():
    bodies = shim_bodies()
    assert len(bodies) > 40, "the parser found too few functions"
    bare = sorted(n for n, b in bodies.items() if "guarded<" not in b and "try {" not in b and n not in CANNOT_THROW)
    assert not bare, f"exported without an exception fence: {bare}"


def test_the_cannot_throw_list_names_real_functions_only():
    bodies = shim_bodies()
    assert not set(CANNOT_THROW) - set(bodies)
    for name in CANNOT_THROW:
        assert "guarded<" not in bodies[name], f"{name} is fenced now: drop it from the list"


def test_every_declared_function_is_defined():
    declared = set(re.findall(r"\b(strata_\w+)\s*\(", re.sub(r"//.*", "", HEADER.read_text())))
    defined = set(shim_bodies())
    # strata_params_parse's callback type and the hooks ABI live elsewhere
    assert declared - defined <= {"strata_usage_fn"}, declared - defined
