"""Our GGUF reader (jaxllm/model_executor/model_loader/gguf_file.py) against gguf's own
`GGUFReader`: the same metadata values (`ReaderField.contents()`), the same tensors (name, type,
shape, dtype, shape of the data and every byte), in both byte orders and with a custom
alignment; and on the embedded model's file. Damaged files are tests/model/test_loader_fuzz.py's."""

from __future__ import annotations

import struct

import gguf
import numpy as np
import pytest

from jaxllm.model_executor.model_loader.gguf_file import read_gguf
from tests.gguf_models import quantized_bytes


def assert_same_as_gguf_reader(path) -> None:
    ours = read_gguf(path)
    reader = gguf.GGUFReader(str(path))
    # The reader adds the header's counts as fields of its own.
    fields = {k: f for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert list(ours.metadata) == list(fields)
    for key, field in fields.items():
        assert ours.metadata[key] == field.contents(), key
    assert [t.name for t in ours.tensors] == [t.name for t in reader.tensors]
    for mine, theirs in zip(ours.tensors, reader.tensors, strict=True):
        assert mine.tensor_type == theirs.tensor_type, mine.name
        assert mine.shape == tuple(int(d) for d in theirs.shape), mine.name
        assert mine.data.dtype == theirs.data.dtype, mine.name
        assert mine.data.shape == theirs.data.shape, mine.name
        assert np.array_equal(mine.data, theirs.data, equal_nan=True), mine.name
        assert not mine.data.flags.writeable


@pytest.mark.parametrize("endian", [gguf.GGUFEndian.LITTLE, gguf.GGUFEndian.BIG])
def test_every_value_and_tensor_type_as_gguf_reads_them(tmp_path, endian):
    rng = np.random.default_rng(0)
    path = tmp_path / "all.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen2", endianess=endian)
    writer.add_custom_alignment(64)
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -100)
    writer.add_uint16("t.u16", 60000)
    writer.add_int16("t.i16", -30000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_float32("t.f32", 0.1)
    writer.add_uint64("t.u64", 2**63 + 5)
    writer.add_int64("t.i64", -(2**62))
    writer.add_float64("t.f64", 0.1)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "naïve 例 <0x0A>")
    writer.add_array("t.ints", [3, -1, 7])
    writer.add_array("t.floats", [0.5, -2.25])
    writer.add_array("t.strs", ["a", "", "ü" * 40])
    writer.add_tensor("f32", rng.standard_normal((3, 32)).astype(np.float32))
    writer.add_tensor("f16", rng.standard_normal((5, 64)).astype(np.float16))
    writer.add_tensor("i32", rng.integers(-9, 9, (7,)).astype(np.int32))
    for fmt in ("Q8_0", "Q4_K", "Q6_K", "Q5_0"):
        writer.add_tensor(fmt.lower(), quantized_bytes(rng, fmt, 2, 256),
                          raw_dtype=gguf.GGMLQuantizationType[fmt])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert_same_as_gguf_reader(path)
    ours = read_gguf(path)
    assert ours.metadata["t.u64"] == 2**63 + 5 and ours.metadata["t.bool"] is True
    assert ours.metadata["t.strs"] == ["a", "", "ü" * 40]
    q8 = next(t for t in ours.tensors if t.name == "q8_0")
    assert q8.shape == (256, 2) and q8.data.shape == (2, 256 // 32 * 34)
    assert ours.byte_order == ("<" if endian == gguf.GGUFEndian.LITTLE else ">")


def _kv(key: str, vtype: int, payload: bytes) -> bytes:
    return struct.pack("<Q", len(key)) + key.encode() + struct.pack("<I", vtype) + payload


def _array(itype: int, items: list[bytes]) -> bytes:
    return struct.pack("<IQ", itype, len(items)) + b"".join(items)


def _string(raw: bytes) -> bytes:
    return struct.pack("<Q", len(raw)) + raw


def test_empty_and_nested_arrays_and_undecodable_text(tmp_path):
    """A header gguf's writer does not produce: empty arrays, an array of arrays, a string that
    is not UTF-8 (kept with replacement characters; gguf's reader raises on it)."""
    u32, string, array = 4, 8, 9
    entries = [
        _kv("t.empty_u32", array, _array(u32, [])),
        _kv("t.empty_str", array, _array(string, [])),
        _kv("t.nested", array, _array(array, [_array(u32, [struct.pack("<I", 1),
                                                           struct.pack("<I", 2)]),
                                              _array(u32, [struct.pack("<I", 3)])])),
    ]
    bad = _kv("t.bad", string, _string(b"ok\xff"))
    for name, kvs in (("odd", entries), ("bad", [*entries, bad])):
        path = tmp_path / f"{name}.gguf"
        path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, len(kvs)) + b"".join(kvs))
        ours = read_gguf(path)
        assert ours.tensors == []
        assert ours.metadata["t.empty_u32"] == [] and ours.metadata["t.empty_str"] == []
        assert ours.metadata["t.nested"] == [1, 2, 3]
    assert ours.metadata["t.bad"] == "ok\ufffd"
    reader = gguf.GGUFReader(str(tmp_path / "odd.gguf"))
    for key in ("t.empty_u32", "t.empty_str", "t.nested"):
        assert read_gguf(tmp_path / "odd.gguf").metadata[key] == reader.fields[key].contents()


def test_a_big_endian_model_is_refused(tmp_path):
    from jaxllm.model_executor.model_loader.errors import ModelLoadError
    from jaxllm.model_executor.model_loader.loader import load_model

    path = tmp_path / "big.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen2", endianess=gguf.GGUFEndian.BIG)
    writer.add_tensor("token_embd.weight", np.ones((8, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match=r"big\.gguf: a big-endian GGUF file is not "
                                             r"supported"):
        load_model(path, progress=False)


@pytest.mark.real_model
def test_the_embedded_model_as_gguf_reads_it():
    from jaxllm.model_executor.model_loader.default_model import default_model_path

    assert_same_as_gguf_reader(default_model_path())


def _write(path, value: int, tensor: np.ndarray) -> None:
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_uint32("t.value", value)
    writer.add_tensor("w", tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_second_read_sees_what_the_file_holds_now(tmp_path, monkeypatch):
    """The second read of a header reuses the first's decoding only while the header's bytes
    are the same: a file rewritten in place (same size, same inode) or replaced is read anew."""
    import jaxllm.model_executor.model_loader.gguf_file as gguf_file

    path = tmp_path / "m.gguf"
    _write(path, 7, np.arange(32, dtype=np.float32))
    first = read_gguf(path)
    decoded = []
    real = gguf_file._header
    monkeypatch.setattr(gguf_file, "_header", lambda w: decoded.append(1) or real(w))
    again = read_gguf(path)
    assert not decoded  # the same bytes: not decoded again
    assert gguf_file._last is None  # and nothing kept after it
    assert again.metadata == first.metadata and again.metadata is not first.metadata
    assert np.array_equal(again.tensors[0].data, np.arange(32))
    # The same size, inode and header length, another value: decoded again.
    raw = bytearray(path.read_bytes())
    at = raw.index(struct.pack("<I", 7), raw.index(b"t.value"))
    raw[at:at + 4] = struct.pack("<I", 9)
    with open(path, "r+b") as f:
        f.write(raw)
    assert read_gguf(path).metadata["t.value"] == 9 and decoded == [1]
    # Only the tensor's data changed: the header is reused, the data is the file's.
    _write(tmp_path / "n.gguf", 9, np.arange(32, dtype=np.float32) * 2)
    with open(path, "r+b") as f:
        f.write((tmp_path / "n.gguf").read_bytes())
    got = read_gguf(path)
    assert decoded == [1] and np.array_equal(got.tensors[0].data, np.arange(32) * 2)
    # Another file at the same path: decoded again.
    path.unlink()
    _write(path, 11, np.arange(32, dtype=np.float32))
    assert read_gguf(path).metadata["t.value"] == 11 and decoded == [1, 1]
    assert_same_as_gguf_reader(path)
