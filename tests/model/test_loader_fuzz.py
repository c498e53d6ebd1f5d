"""Model files are input too: damaged GGUF files and safetensors checkpoints (truncated, bits
flipped in headers, tensor infos and metadata, absurd dimensions, offsets and block types) load
or fail with ModelLoadError naming the file; never another exception, a hang, or memory beyond
a small multiple of the file's size."""

from __future__ import annotations

import json
import re
import shutil
import signal
import struct
import tracemalloc
from contextlib import contextmanager
from pathlib import Path

import gguf
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxllm.model_executor.layers.quantization import cpu_dequant_matmul
from jaxllm.model_executor.model_loader.errors import ModelLoadError
from jaxllm.model_executor.model_loader.loader import load_model
from tests.gguf_models import write_tiny_gguf
from tests.utils import save_tiny_checkpoint

# Damaged block bytes dequantize to NaN and inf: numpy's warnings about them are expected.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

FUZZ = settings(max_examples=100, derandomize=True, deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])
# Seconds one load may take: the intact files load in well under one.
HANG_S = 20
# Values a hostile header may hold in a count, dimension, type or offset field.
ABSURD = st.sampled_from([0, 1, 3, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**40, 2**62, 2**63,
                          2**64 - 1]) | st.integers(0, 2**64 - 1)


class Hang(BaseException):
    """Not an Exception: the loader's handlers of a reader's assorted errors must not turn a
    hang into a clean failure."""


@contextmanager
def _watchdog(seconds: int):
    def fire(signum, frame):
        raise Hang(f"load still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, fire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _check_load(path: Path, budget_bytes: int, **kw) -> None:
    """Load `path`: either it loads, or ModelLoadError names the file; the numpy memory it
    allocates stays within `budget_bytes`."""
    tracemalloc.start()
    try:
        with _watchdog(HANG_S):
            load_model(path, progress=False, **kw)
    except ModelLoadError as e:
        assert path.name in str(e), f"the error does not name the file: {e}"
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert peak <= budget_bytes, f"{peak} bytes allocated for a {path.stat().st_size}-byte model"


# --- GGUF ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """The intact file's bytes and where its fields lie: the end of the header, each metadata
    entry's and each tensor info's first byte."""
    path = tmp_path_factory.mktemp("gguf_fuzz") / "tiny.gguf"
    write_tiny_gguf(path)
    reader = gguf.GGUFReader(str(path))
    kv = [f.offset for name, f in reader.fields.items() if not name.startswith("GGUF.")]
    infos = [t.field.offset for t in reader.tensors]
    return path.read_bytes(), reader.data_offset, kv, infos


def _tensor_info_fields(data: bytes, at: int) -> dict[str, tuple[int, int]]:
    """{field: (byte offset, size)} of the tensor info starting at `at`."""
    (name_len,) = struct.unpack_from("<Q", data, at)
    n_dims_at = at + 8 + name_len
    (n_dims,) = struct.unpack_from("<I", data, n_dims_at)
    fields = {"n_dims": (n_dims_at, 4)}
    for i in range(n_dims):
        fields[f"dim{i}"] = (n_dims_at + 4 + 8 * i, 8)
    type_at = n_dims_at + 4 + 8 * n_dims
    fields["type"] = (type_at, 4)
    fields["offset"] = (type_at + 4, 8)
    fields["name_len"] = (at, 8)
    return fields


@st.composite
def gguf_damage(draw, original):
    """A damage to apply to the file (kind, byte offset, value): shown compactly on failure."""
    data, header_end, kv, infos = original
    kind = draw(st.sampled_from(["truncate", "flip_header", "flip_metadata", "metadata_type",
                                 "tensor_info", "block_type", "counts"]))
    if kind == "truncate":
        return kind, draw(st.integers(0, len(data) - 1)), None
    if kind == "metadata_type":  # a value read as another type: an array's length from its bytes
        at = draw(st.sampled_from(kv))
        (key_len,) = struct.unpack_from("<Q", data, at)
        return kind, (at + 8 + key_len, 4), draw(st.sampled_from([9, 8, 12, 13, 2**32 - 1])
                                                  | st.integers(0, 12))
    if kind in ("flip_header", "flip_metadata"):
        lo, hi = (0, header_end) if kind == "flip_header" else (kv[0], infos[0])
        flips = draw(st.lists(st.tuples(st.integers(lo, hi - 1), st.integers(0, 7)),
                              min_size=1, max_size=4))
        return kind, None, flips
    if kind == "counts":  # the tensor and metadata counts right after the version
        return kind, (draw(st.sampled_from([8, 16])), 8), draw(ABSURD)
    info = _tensor_info_fields(data, draw(st.sampled_from(infos)))
    if kind == "block_type":
        # Unknown ids, ids gguf no longer defines, and real types of other sizes.
        value = draw(st.sampled_from([4, 5, 3, 7, 16, 19, 31, 39, 1000, 2**32 - 1])
                     | st.integers(0, 2**32 - 1))
        return kind, info["type"], value
    at, size = info[draw(st.sampled_from(sorted(info)))]
    return kind, (at, size), draw(ABSURD) % (1 << (8 * size))


def _damaged(data: bytes, damage: tuple) -> bytes:
    kind, where, value = damage
    if kind == "truncate":
        return data[:where]
    out = bytearray(data)
    if kind.startswith("flip"):
        for pos, bit in value:
            out[pos] ^= 1 << bit
        return bytes(out)
    at, size = where
    out[at:at + size] = struct.pack("<Q" if size == 8 else "<I", value)
    return bytes(out)


def _gguf_budget(size: int) -> int:
    # Loading dequantizes block formats of >= 4.5 bits per value to float32 and stacks fused
    # weights: ~16x the file at most; absurd headers must not push it further.
    return 24 * size + (32 << 20)


def test_intact_gguf_loads_within_the_memory_budget(tiny_gguf, tmp_path):
    path = tmp_path / "intact.gguf"
    path.write_bytes(tiny_gguf[0])
    _check_load(path, _gguf_budget(len(tiny_gguf[0])))
    _check_load(path, _gguf_budget(len(tiny_gguf[0])), quantization="gguf")


@FUZZ
@given(data=st.data(), quantization=st.sampled_from([None, "gguf"]))
def test_damaged_gguf_fails_cleanly(tiny_gguf, tmp_path, data, quantization):
    damage = data.draw(gguf_damage(tiny_gguf), label="damage")
    path = tmp_path / "damaged.gguf"
    path.write_bytes(_damaged(tiny_gguf[0], damage))
    _check_load(path, _gguf_budget(len(tiny_gguf[0])), quantization=quantization)


@pytest.mark.parametrize("field,value,problem", [
    ("dim1", 2**40, "past the end of the file"),
    ("dim0", 0, "each must be positive"),
    ("offset", 2**63, "past the end of the file"),
    ("n_dims", 7, "7 dimensions"),
    ("type", 1000, "unknown type 1000"),
])
def test_absurd_tensor_info_is_named(tiny_gguf, tmp_path, field, value, problem):
    data, _, _, infos = tiny_gguf
    at, size = _tensor_info_fields(data, infos[0])[field]
    out = bytearray(data)
    out[at:at + size] = struct.pack("<Q" if size == 8 else "<I", value)
    path = tmp_path / "absurd.gguf"
    path.write_bytes(bytes(out))
    with pytest.raises(ModelLoadError, match=rf"absurd\.gguf: truncated or corrupt GGUF file: "
                                             rf"tensor 'token_embd\.weight'.*{problem}"):
        load_model(path, progress=False)


def test_huge_metadata_array_length_fails_fast(tmp_path):
    """An array length past the end: gguf's reader alone would loop on empty reads for ever."""
    path = tmp_path / "array.gguf"
    body = b"GGUF" + struct.pack("<IQQ", 3, 0, 1)
    key = b"general.junk"
    body += struct.pack("<Q", len(key)) + key + struct.pack("<IIQ", 9, 0, 2**60)
    path.write_bytes(body)
    want = rf"array\.gguf: .*'general\.junk' \({2**60} items\)"
    with _watchdog(HANG_S), pytest.raises(ModelLoadError, match=want):
        load_model(path, progress=False)


# --- safetensors -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    path = tmp_path_factory.mktemp("st_fuzz")
    save_tiny_checkpoint(path, tied=False)
    data = (path / "model.safetensors").read_bytes()
    (header_len,) = struct.unpack_from("<Q", data, 0)
    header = json.loads(data[8:8 + header_len])
    return path, data, header


def _with_header(data: bytes, header: dict) -> bytes:
    old_len = struct.unpack_from("<Q", data, 0)[0]
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data[8 + old_len:]


@st.composite
def safetensors_damage(draw, original):
    """(kind, detail): a damage to the weights file or config.json, shown compactly."""
    _, data, header = original
    kind = draw(st.sampled_from(["truncate", "flip_header", "header_len", "shape", "offsets",
                                 "dtype", "config", "config_bytes"]))
    if kind == "truncate":
        return kind, draw(st.integers(0, len(data) - 1))
    if kind == "config_bytes":  # config.json itself damaged: bad UTF-8, broken or other JSON
        size = len((original[0] / "config.json").read_bytes())
        return kind, draw(st.lists(st.tuples(st.integers(0, size - 1), st.integers(0, 7)),
                                   min_size=1, max_size=4))
    if kind == "flip_header":
        header_end = 8 + struct.unpack_from("<Q", data, 0)[0]
        return kind, draw(st.lists(st.tuples(st.integers(0, header_end - 1),
                                             st.integers(0, 7)), min_size=1, max_size=4))
    if kind == "header_len":
        return kind, draw(ABSURD)
    if kind == "config":
        key = draw(st.sampled_from(["hidden_size", "num_hidden_layers", "num_attention_heads",
                                    "num_key_value_heads", "vocab_size", "intermediate_size",
                                    "max_position_embeddings", "rope_theta", "head_dim",
                                    "rms_norm_eps"]))
        return kind, (key, draw(st.sampled_from([0, -1, 10**12, 2**63, 10**400, "x", None, [],
                                                  1.5, float("nan"), True])))
    name = draw(st.sampled_from(sorted(k for k in header if k != "__metadata__")))
    if kind == "shape":
        value = draw(st.lists(ABSURD, max_size=5))
    elif kind == "offsets":
        value = [draw(ABSURD), draw(ABSURD)]
    else:
        value = draw(st.sampled_from(["F64", "I64", "U8", "BOOL", "F8_E4M3", "Q4_0", "", "f32"]))
    return kind, (name, value)


def _damaged_checkpoint(original, damage: tuple, ckpt: Path) -> None:
    src, data, header = original
    kind, detail = damage
    config = json.loads((src / "config.json").read_text())
    config_bytes = None
    if kind == "config_bytes":
        out = bytearray((src / "config.json").read_bytes())
        for pos, bit in detail:
            out[pos] ^= 1 << bit
        config_bytes = bytes(out)
    elif kind == "truncate":
        data = data[:detail]
    elif kind == "flip_header":
        out = bytearray(data)
        for pos, bit in detail:
            out[pos] ^= 1 << bit
        data = bytes(out)
    elif kind == "header_len":
        data = struct.pack("<Q", detail) + data[8:]
    elif kind == "config":
        config[detail[0]] = detail[1]
    else:
        name, value = detail
        header = json.loads(json.dumps(header))
        header[name][{"shape": "shape", "offsets": "data_offsets", "dtype": "dtype"}[kind]] = value
        data = _with_header(data, header)
    ckpt.mkdir()
    (ckpt / "config.json").write_bytes(config_bytes or json.dumps(config).encode())
    (ckpt / "model.safetensors").write_bytes(data)


def _hf_budget(size: int) -> int:
    # The tensors are read into numpy once and stacked for the fused weights.
    return 4 * size + (32 << 20)


@FUZZ
@given(data=st.data())
def test_damaged_safetensors_fails_cleanly(tiny_hf, tmp_path, data):
    damage = data.draw(safetensors_damage(tiny_hf), label="damage")
    ckpt = tmp_path / "damaged_ckpt"
    shutil.rmtree(ckpt, ignore_errors=True)
    # NaN goes into config.json as Python's json writes (and reads back) it.
    _damaged_checkpoint(tiny_hf, damage, ckpt)
    tracemalloc.start()
    try:
        with _watchdog(HANG_S):
            load_model(ckpt, progress=False)
    except ModelLoadError as e:
        assert "damaged_ckpt" in str(e), f"the error does not name the checkpoint: {e}"
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert peak <= _hf_budget(len(tiny_hf[1])), peak


def test_config_with_wrong_types_is_named(tiny_hf, tmp_path):
    src, _, _ = tiny_hf
    ckpt = tmp_path / "cfg_types"
    shutil.copytree(src, ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    config["num_attention_heads"] = "four"
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"cfg_types.*num_attention_heads"):
        load_model(ckpt, progress=False)


@pytest.mark.parametrize("file,text,problem", [
    ("config.json", "[" * 100_000 + "]" * 100_000, "cannot read model config: RecursionError"),
    ("config.json", b"{\"hidden_size\": \xff}", "cannot read model config: UnicodeDecodeError"),
    ("config.json", "[1, 2]", "must be a JSON object, got list"),
    ("model.safetensors.index.json", "[" * 100_000, "not a safetensors index"),
    ("model.safetensors.index.json", '{"weight_map": [1]}', "weight_map must map"),
    ("model.safetensors.index.json", '{"weight_map": {"a": 5}}', "weight_map must map"),
    ("model.safetensors.index.json", '{"weight_map": {"a": "../x.safetensors"}}',
     "weight_map must map"),
])
def test_damaged_json_is_named(tiny_hf, tmp_path, file, text, problem):
    ckpt = tmp_path / "json_ckpt"
    shutil.copytree(tiny_hf[0], ckpt)
    (ckpt / file).write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ModelLoadError, match=rf"json_ckpt/{re.escape(file)}: .*{problem}"):
        load_model(ckpt, progress=False)


# --- the CPU kernel's inputs -------------------------------------------------------------------


@pytest.mark.parametrize("shapes,problem", [
    (((2, 64), (2, 64, 16), (2, 2, 16), None), None),  # the well-formed call, for contrast
    (((2, 64), (2, 64, 16), (2, 3, 16), None), "block"),
    (((2, 64), (2, 64, 8), (2, 2, 8), None), "panels of 8 features"),
    (((2, 32), (2, 64, 16), (2, 2, 16), None), r"x \[T, in\]"),
    (((2, 64), (2, 64, 16), (1, 2, 16), None), "scale"),
    (((2, 64), (2, 64, 16), (2, 2, 16), (2, 4, 16)), "offset"),
    (((2, 64, 1), (2, 64, 16), (2, 2, 16), None), "x"),
    (((2, 64), (32, 64), (32, 2), None), "must be 3-D; qweight"),  # rows, not panels
])
def test_cpu_kernel_inputs_checked_before_the_call(shapes, problem):
    x_shape, q_shape, s_shape, o_shape = shapes
    x = np.ones(x_shape, np.float32)
    q = np.ones(q_shape, np.int8)
    scale = np.ones(s_shape, np.float32)
    offset = None if o_shape is None else np.zeros(o_shape, np.float32)
    if problem is None:
        cpu_dequant_matmul.check_inputs(x, q, scale, offset)
        return
    with pytest.raises(ValueError, match=rf"dequant_matmul: .*{problem}"):
        cpu_dequant_matmul.check_inputs(x, q, scale, offset)
