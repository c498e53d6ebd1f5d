"""A GGUF file's header and tensors, read with every count and offset checked against its size.

`gguf.GGUFReader` trusts every count and offset in the file: an array length flipped to 2**60
makes it loop for ever past the end (reads there come back empty rather than failing), and a
tensor's dimensions may claim more bytes than the file holds. It also turns every metadata item
into numpy views, several per string, which for a tokenizer's vocabulary and merges takes
seconds. This reader walks the header once, bounds each count by the bytes left before looping
over it, decodes the metadata to Python values (what `ReaderField.contents()` gives) and checks
that every tensor's data (its type's block size times its dimensions) lies inside the file; the
tensors are views of one read-only memory map, shaped as `GGUFReader` shapes them. gguf's tables
(types, block sizes) and dequantization are used as they are.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from jaxllm.model_executor.model_loader.errors import ModelLoadError

GGUF_MAGIC = b"GGUF"
_VERSIONS = (2, 3)
_MAX_DIMS = 4  # GGML_MAX_DIMS
_DEFAULT_ALIGNMENT = 32
# GGUF value types (gguf's GGUFValueType) of fixed size, by struct format; 8 string, 9 array.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
            12: "d"}
_STRING, _ARRAY, _UINT32 = 8, 9, 4
_MAX_ARRAY_DEPTH = 4
# Tensor types GGUFReader views as numbers; every other type as its blocks' bytes.
_NUMERIC = {GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F32: np.float32,
            GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
            GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
            GGMLQuantizationType.I64: np.int64}


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor: `shape` in GGUF's order (fastest dimension first), `data` a read-only view
    of the file (numbers for float and integer types, else [..., bytes per row] uint8)."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray


@dataclass(frozen=True)
class GGUFFile:
    metadata: dict[str, Any]
    tensors: list[GGUFTensor]
    byte_order: str  # "<" little-endian (llama.cpp's), ">" big-endian


class _Walk:
    """A cursor over the file's bytes that refuses to step past the end."""

    def __init__(self, data: np.ndarray, path: Path, order: str) -> None:
        self.data, self.path, self.order, self.pos = data, path, order, 0
        self.buf = data.data  # a memoryview of the map

    def fail(self, what: str) -> ModelLoadError:
        return ModelLoadError(f"{self.path}: truncated or corrupt GGUF file: {what}")

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > len(self.data):
            raise self.fail(f"{what} at byte {self.pos} needs {n} bytes, the file ends at "
                            f"{len(self.data)} (truncated?)")

    def scalar(self, fmt: str, what: str) -> Any:
        size = struct.calcsize(fmt)
        self.need(size, what)
        (value,) = struct.unpack_from(self.order + fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self, what: str) -> str:
        n = self.scalar("Q", f"{what} length")
        self.need(n, what)
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        # An undecodable string is kept with replacement characters: nothing that reads the
        # model needs one, and a tokenizer's vocabulary is read from the file by its own code.
        return raw.decode("utf-8", "replace")

    def value(self, vtype: int, what: str, depth: int = 0) -> Any:
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype], what)
        if vtype == _STRING:
            return self.string(what)
        if vtype != _ARRAY:
            raise self.fail(f"{what} has unknown value type {vtype}")
        if depth >= _MAX_ARRAY_DEPTH:
            raise self.fail(f"{what} nests arrays deeper than {_MAX_ARRAY_DEPTH}")
        itype = self.scalar("I", f"{what} item type")
        count = self.scalar("Q", f"{what} item count")
        if itype in _SCALARS:
            dtype = np.dtype(self.order + _SCALARS[itype])
            self.need(count * dtype.itemsize, f"{what} ({count} items)")
            items = np.frombuffer(self.buf, dtype, count, self.pos).tolist()
            self.pos += count * dtype.itemsize
            return items
        # Strings and arrays take at least 8 bytes (their length or item count) each.
        self.need(count * 8, f"{what} ({count} items)")
        if itype == _ARRAY:  # as ReaderField.contents(): nested arrays flattened
            return [v for _ in range(count) for v in self.value(itype, what, depth + 1)]
        return [self.value(itype, what, depth + 1) for _ in range(count)]


# The last header read and not read again yet: (path, inode, size), the header's bytes and
# what they gave (metadata, tensor infos, byte order), not the file's mapping. Start-up reads a
# header twice (whether the weights can stay quantized, then the load); the second read compares
# bytes instead of decoding the metadata again, and takes what was decoded (nothing is kept).
_Header = tuple[dict[str, Any], list[tuple[str, tuple[int, ...], int, int]], str]
_last: tuple[tuple[str, int, int], bytes, _Header] | None = None


def read_gguf(path: Path) -> GGUFFile:
    """The file's metadata and tensors; ModelLoadError naming `path` and the problem unless
    every count, dimension and offset in its header is consistent with its size."""
    global _last
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8 or head[:4] != GGUF_MAGIC:
            raise ModelLoadError(f"{path}: not a GGUF file (magic {head[:4]!r}, expected "
                                 f"{GGUF_MAGIC!r})")
        st = os.fstat(f.fileno())
        key = (os.path.abspath(path), st.st_ino, st.st_size)
        last = _last
        same = last is not None and last[0] == key and head + f.read(len(last[1]) - 8) == last[1]
    # Memory-mapped: the header's pages are read now, each tensor's when it is used.
    data = np.memmap(path, dtype=np.uint8, mode="r")
    if same:
        assert last is not None
        metadata, infos, order = last[2]
        w = _Walk(data, path, order)
        _last = None
    else:
        w = _Walk(data, path, _byte_order(head, path))
        metadata, infos = _header(w)
        _last = (key, bytes(w.buf[:w.pos]), (metadata, infos, w.order))
        metadata = dict(metadata)
    tensors, names = [], set()
    for name, dims, raw_type, start in infos:
        if name in names:
            raise w.fail(f"tensor {name!r} is listed twice")
        names.add(name)
        tensors.append(_tensor(w, name, dims, raw_type, start))
    return GGUFFile(metadata, tensors, w.order)


def _header(w: _Walk) -> tuple[dict[str, Any], list[tuple[str, tuple[int, ...], int, int]]]:
    """The metadata and the tensor infos (name, dimensions, type, absolute start)."""
    w.pos = 8
    tensor_count = w.scalar("Q", "tensor count")
    kv_count = w.scalar("Q", "metadata count")
    # A key/value entry takes at least 8 + 4 + 1 bytes, a tensor info 8 + 4 + 8 + 4 + 8.
    w.need(kv_count * 13 + tensor_count * 32, f"{kv_count} metadata entries and "
                                               f"{tensor_count} tensor infos")
    metadata: dict[str, Any] = {}
    alignment = _DEFAULT_ALIGNMENT
    for _ in range(kv_count):
        key = w.string("metadata key")
        if key in metadata:
            raise w.fail(f"metadata key {key!r} is listed twice")
        vtype = w.scalar("I", f"metadata {key!r} type")
        value = metadata[key] = w.value(vtype, f"metadata {key!r}")
        if key == "general.alignment":
            if vtype != _UINT32 or not value or value & (value - 1):
                raise w.fail(f"general.alignment must be a uint32 power of two, got {value}")
            alignment = value
    infos = []
    for _ in range(tensor_count):
        name = w.string("tensor name")
        n_dims = w.scalar("I", f"tensor {name!r} dimension count")
        if not 1 <= n_dims <= _MAX_DIMS:
            raise w.fail(f"tensor {name!r} has {n_dims} dimensions (1 to {_MAX_DIMS})")
        dims = tuple(w.scalar("Q", f"tensor {name!r} dimensions") for _ in range(n_dims))
        raw_type = w.scalar("I", f"tensor {name!r} type")
        offset = w.scalar("Q", f"tensor {name!r} offset")
        infos.append((name, dims, raw_type, offset))
    data_start = -(-w.pos // alignment) * alignment
    return metadata, [(name, dims, raw_type, data_start + offset)
                      for name, dims, raw_type, offset in infos]


def _tensor(w: _Walk, name: str, dims: tuple[int, ...], raw_type: int, start: int
            ) -> GGUFTensor:
    try:
        qtype = GGMLQuantizationType(raw_type)
        block, block_bytes = GGML_QUANT_SIZES[qtype]
    except (ValueError, KeyError):
        raise w.fail(f"tensor {name!r} has unknown type {raw_type}") from None
    if any(d == 0 for d in dims) or dims[0] % block:
        raise w.fail(f"tensor {name!r} has dimensions {list(dims)}: each must be positive and "
                     f"the first a multiple of the {qtype.name} block ({block})")
    n_elements = int(np.prod(dims, dtype=object))
    nbytes = n_elements // block * block_bytes
    end = start + nbytes
    if end > len(w.data):
        raise w.fail(f"tensor {name!r} ({qtype.name} {list(dims)}, {nbytes} bytes at offset "
                     f"{start}) ends at byte {end}, past the end of the file ({len(w.data)})")
    shape = tuple(reversed(dims))
    if qtype in _NUMERIC:
        dtype = np.dtype(w.order + np.dtype(_NUMERIC[qtype]).str[1:])  # '<f2' -> '>f2'
    else:
        dtype = np.dtype(np.uint8)
        shape = (*shape[:-1], shape[-1] // block * block_bytes)
    return GGUFTensor(name, qtype, dims, w.data[start:end].view(dtype).reshape(shape))


def _byte_order(head: bytes, path: Path) -> str:
    # The reader tells a file of the other byte order by a version whose low half is 0.
    order = "<" if struct.unpack_from("<I", head, 4)[0] & 0xFFFF else ">"
    version = struct.unpack_from(order + "I", head, 4)[0]
    if version not in _VERSIONS:
        raise ModelLoadError(f"{path}: GGUF version {version} is not supported "
                             f"({', '.join(map(str, _VERSIONS))})")
    return order
