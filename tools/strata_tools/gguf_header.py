"""A GGUF file's header without gguf-py: its scalar and string KVs, and each tensor's name,
dimensions, ggml type and size in bytes."""

from __future__ import annotations

import struct
from pathlib import Path

# (block size, bytes per block) of ggml types, by type id (ggml.h / gguf-py GGML_QUANT_SIZES).
TYPE_SIZES = {
    0: (1, 4), 1: (1, 2), 2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34),
    10: (256, 84), 11: (256, 110), 12: (256, 144), 13: (256, 176), 14: (256, 210), 15: (256, 292),
    16: (256, 66), 17: (256, 74), 18: (256, 98), 19: (256, 50), 20: (32, 18), 21: (256, 110),
    22: (256, 82), 23: (256, 136), 30: (1, 2),
}
SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


class GGUFError(ValueError):
    """The file is not a GGUF file, or its header is cut short or holds an unknown value type."""


def gguf_tensors(path: Path) -> tuple[dict, list[tuple[str, list[int], int]]]:
    """Scalar and string KVs, and (name, dims, ggml type id) of every tensor, from a GGUF header."""
    with open(path, "rb") as f:
        def take(fmt: str):
            return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]

        def string() -> str:
            return f.read(take("<Q")).decode(errors="replace")

        def value(vtype: int):
            if vtype == 8:
                return string()
            if vtype == 9:
                etype, n = take("<I"), take("<Q")
                return [value(etype) for _ in range(n)]
            return take(SCALAR[vtype])

        try:
            magic, _version, n_tensors, n_kv = struct.unpack("<IIQQ", f.read(24))
            if magic != 0x46554747:
                raise GGUFError(f"{path} is not a GGUF file")
            kv = {}
            for _ in range(n_kv):
                key = string()
                v = value(take("<I"))
                if not isinstance(v, list):
                    kv[key] = v
            tensors = []
            for _ in range(n_tensors):
                name = string()
                dims = [take("<Q") for _ in range(take("<I"))]
                ttype = take("<I")
                take("<Q")  # offset
                tensors.append((name, dims, ttype))
        except (struct.error, KeyError) as e:
            raise GGUFError(f"{path}: the GGUF header is cut short or unreadable ({e})") from None
    return kv, tensors


def read_gguf(path: Path) -> tuple[dict, list[tuple[str, int]]]:
    """Scalar and string KVs, and (name, bytes) of every tensor, from a GGUF header."""
    kv, infos = gguf_tensors(path)
    tensors = []
    for name, dims, ttype in infos:
        block, size = TYPE_SIZES[ttype]
        n = 1
        for d in dims:
            n *= d
        tensors.append((name, n // block * size))
    return kv, tensors
