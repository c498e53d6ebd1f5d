"""A GGUF file's layout checked against its size before `gguf.GGUFReader` reads it.

The reader trusts every count and offset in the file: an array length flipped to 2**60 makes
it loop for ever past the end (reads there come back empty rather than failing), and a tensor's
dimensions may claim more bytes than the file holds. This walk reads only the header, key/value
metadata and tensor infos, bounds each count by the bytes left before looping over it, and checks
that every tensor's data (its type's block size times its dimensions) lies inside the file, so
nothing downstream allocates or reads beyond what the file really contains.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from jaxllm.model_executor.model_loader.errors import ModelLoadError

GGUF_MAGIC = b"GGUF"
_VERSIONS = (2, 3)
_MAX_DIMS = 4  # GGML_MAX_DIMS
_DEFAULT_ALIGNMENT = 32
# GGUF value types (gguf's GGUFValueType): fixed sizes, then string 8 and array 9.
_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY, _UINT32 = 8, 9, 4
_MAX_ARRAY_DEPTH = 4


class _Walk:
    """A cursor over the file's bytes that refuses to step past the end."""

    def __init__(self, data: mmap.mmap, path: Path, order: str) -> None:
        self.data, self.path, self.order, self.pos = data, path, order, 0

    def fail(self, what: str) -> ModelLoadError:
        return ModelLoadError(f"{self.path}: truncated or corrupt GGUF file: {what}")

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > len(self.data):
            raise self.fail(f"{what} at byte {self.pos} needs {n} bytes, the file ends at "
                            f"{len(self.data)} (truncated?)")

    def uint(self, size: int, what: str) -> int:
        self.need(size, what)
        fmt = {4: "I", 8: "Q"}[size]
        (value,) = struct.unpack_from(self.order + fmt, self.data, self.pos)
        self.pos += size
        return value

    def string(self, what: str) -> bytes:
        n = self.uint(8, f"{what} length")
        self.need(n, what)
        value = self.data[self.pos:self.pos + n]
        self.pos += n
        return value

    def value(self, vtype: int, what: str, depth: int = 0) -> int | None:
        """Skip one value; returns it when it is a uint32 (general.alignment)."""
        if vtype in _SCALAR_SIZES:
            if vtype == _UINT32:
                return self.uint(4, what)
            self.need(_SCALAR_SIZES[vtype], what)
            self.pos += _SCALAR_SIZES[vtype]
            return None
        if vtype == _STRING:
            self.string(what)
            return None
        if vtype != _ARRAY:
            raise self.fail(f"{what} has unknown value type {vtype}")
        if depth >= _MAX_ARRAY_DEPTH:
            raise self.fail(f"{what} nests arrays deeper than {_MAX_ARRAY_DEPTH}")
        itype = self.uint(4, f"{what} item type")
        count = self.uint(8, f"{what} item count")
        if itype in _SCALAR_SIZES:
            self.need(count * _SCALAR_SIZES[itype], f"{what} ({count} items)")
            self.pos += count * _SCALAR_SIZES[itype]
            return None
        # Strings and arrays take at least 8 bytes (their length or item count) each.
        self.need(count * 8, f"{what} ({count} items)")
        for _ in range(count):
            self.value(itype, what, depth + 1)
        return None


def check_gguf_layout(path: Path) -> None:
    """Raise ModelLoadError naming `path` and the problem unless every count, dimension and
    offset in the file's header is consistent with its size."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8 or head[:4] != GGUF_MAGIC:
            raise ModelLoadError(f"{path}: not a GGUF file (magic {head[:4]!r}, expected "
                                 f"{GGUF_MAGIC!r})")
        # Memory-mapped: only the pages of the header are read.
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            _check(_Walk(data, path, _byte_order(head, path)), len(data))


def _byte_order(head: bytes, path: Path) -> str:
    # The reader tells a file of the other byte order by a version whose low half is 0.
    order = "<" if struct.unpack_from("<I", head, 4)[0] & 0xFFFF else ">"
    version = struct.unpack_from(order + "I", head, 4)[0]
    if version not in _VERSIONS:
        raise ModelLoadError(f"{path}: GGUF version {version} is not supported "
                             f"({', '.join(map(str, _VERSIONS))})")
    return order


def _check(w: _Walk, size: int) -> None:
    w.pos = 8
    tensor_count = w.uint(8, "tensor count")
    kv_count = w.uint(8, "metadata count")
    # A key/value entry takes at least 8 + 4 + 1 bytes, a tensor info 8 + 4 + 8 + 4 + 8.
    w.need(kv_count * 13 + tensor_count * 32, f"{kv_count} metadata entries and "
                                               f"{tensor_count} tensor infos")
    alignment = _DEFAULT_ALIGNMENT
    for _ in range(kv_count):
        key = w.string("metadata key").decode("utf-8", "replace")
        vtype = w.uint(4, f"metadata {key!r} type")
        value = w.value(vtype, f"metadata {key!r}")
        if key == "general.alignment":
            if vtype != _UINT32 or not value or value & (value - 1):
                raise w.fail(f"general.alignment must be a uint32 power of two, got {value}")
            alignment = value
    infos = []
    for _ in range(tensor_count):
        name = w.string("tensor name").decode("utf-8", "replace")
        n_dims = w.uint(4, f"tensor {name!r} dimension count")
        if not 1 <= n_dims <= _MAX_DIMS:
            raise w.fail(f"tensor {name!r} has {n_dims} dimensions (1 to {_MAX_DIMS})")
        dims = [w.uint(8, f"tensor {name!r} dimensions") for _ in range(n_dims)]
        raw_type = w.uint(4, f"tensor {name!r} type")
        offset = w.uint(8, f"tensor {name!r} offset")
        infos.append((name, dims, raw_type, offset))
    data_start = -(-w.pos // alignment) * alignment
    for name, dims, raw_type, offset in infos:
        try:
            qtype = GGMLQuantizationType(raw_type)
            block, block_bytes = GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise w.fail(f"tensor {name!r} has unknown type {raw_type}") from None
        if any(d == 0 for d in dims) or dims[0] % block:
            raise w.fail(f"tensor {name!r} has dimensions {dims}: each must be positive and "
                         f"the first a multiple of the {qtype.name} block ({block})")
        n_elements = 1
        for d in dims:
            n_elements *= d
        nbytes = n_elements // block * block_bytes
        end = data_start + offset + nbytes
        if end > size:
            raise w.fail(f"tensor {name!r} ({qtype.name} {dims}, {nbytes} bytes at offset "
                         f"{offset}) ends at byte {end}, past the end of the file ({size})")
