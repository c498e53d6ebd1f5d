"""The CPU fused dequant matmul kernel (jaxllm/model_executor/layers/quantization/
cpu_dequant_matmul.cc), the XLA FFI custom call quantization="gguf" runs on CPU.

Against independent oracles: the weights its block sums apply are bit-for-bit gguf's float32
values (a unit vector picks one weight column out exactly), its products agree with a float64
matmul of gguf's dequantized weights, and each row's result is bit-identical whatever other
rows share the call.
Also the panel layout (packing moves values only), the build (cached, a compile error named)
and the fallback to XLA's fused GEMVs.
"""

from __future__ import annotations

import ctypes
import functools
import platform

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.model_executor.layers import cpu_ffi
from jaxllm.model_executor.layers.quantization import cpu_dequant_matmul as kernel
from jaxllm.model_executor.layers.quantization.gguf import GGUFWeight, dequantize, gguf_linear
from jaxllm.model_executor.model_loader import gguf_repack
from tests.gguf_models import random_blocks

if jax.default_backend() != "cpu":  # registered for XLA's CPU backend only
    pytest.skip("the CPU kernel runs on JAX's CPU backend", allow_module_level=True)
if not kernel.available():  # visible, never a silent pass: the suite's machines have g++
    pytest.skip("no C++ compiler to build the CPU kernel", allow_module_level=True)


def _weight(rng, fmt: str, shape: tuple[int, int], signed_zeros: bool = False,
            compact: bool = False):
    raw = random_blocks(rng, fmt, *shape, signed_zeros=signed_zeros)
    want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[fmt]).reshape(shape)
    r = gguf_repack.repack(raw, fmt, shape, "t")
    w = GGUFWeight(*(None if a is None else jnp.asarray(a)
                     for a in kernel.pack(r.qweight, r.scale, r.offset, compact)))
    return w, want


@functools.cache
def _jitted(isa: str | None):
    return jax.jit(functools.partial(kernel.dequant_matmul, isa=isa))


def _call(x, w: GGUFWeight, isa: str | None = None):
    """The kernel's `isa` build (cpu_isa: native and, on x86, AVX2), else the process's."""
    return np.asarray(_jitted(isa)(x, w.qweight, w.scale, w.offset))


# Q4_K / Q5_K: 32-value blocks with offsets; Q6_K: 16-value blocks; Q8_0 / Q5_0 / Q4_0: no
# offsets. Q5_0 / Q4_0 / Q4_K values fit 5 bits: in panels of 64 they pack as 5-bit panels.
FORMATS = ["Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q5_0", "Q4_0"]
FIVE_BIT = {"Q4_K", "Q5_0", "Q4_0"}


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("out,compact", [(48, False), (128, False), (128, True)])
def test_weights_are_ggufs_values_bit_for_bit(fmt, out, compact, rng, cpu_isa):
    """x = unit vectors: row k of the result is column k of the weight times 1 (the block's
    scale times the integer value, plus the offset times 1); it must be gguf's float32 value
    exactly (signed zeros of zero scales aside, which a sum cannot tell apart). 48 rows are
    int8 panels of 16; 128 rows panels of 64, compact: 5-bit ones where the values fit."""
    w, want = _weight(rng, fmt, (out, 256), signed_zeros=True, compact=compact)
    assert kernel.is_q5(w.qweight) == (compact and fmt in FIVE_BIT)
    cols = np.array([0, 1, 15, 16, 17, 31, 32, 100, 255])
    x = np.zeros((len(cols), 256), np.float32)
    x[np.arange(len(cols)), cols] = 1.0
    got = _call(jnp.asarray(x), w, cpu_isa)
    np.testing.assert_array_equal(got, want[:, cols].T)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 64, 65, 130])
def test_matches_float64_matmul(fmt, rows, rng, cpu_isa):
    """Every register tile (6 rows and the remainders 1-5; four, two or one vectors of
    features, per build), blocks of rows past 64, and every panel width: 1008 output rows are
    panels of 16, 80 of 16, 96 of 32, 128 of 64 (and compact: 5-bit where the values fit)."""
    for shape, compact in (((1008, 256), False), ((80, 512), False),
                           ((96, 4864) if fmt == "Q6_K" else (96, 512), False),
                           ((128, 256), False), ((128, 256), True)):
        w, want = _weight(rng, fmt, shape, compact=compact)
        x = rng.standard_normal((rows, shape[1])).astype(np.float32)
        got = _call(jnp.asarray(x), w, cpu_isa)
        ref = x.astype(np.float64) @ want.astype(np.float64).T
        bound = np.abs(x).astype(np.float64) @ np.abs(want).astype(np.float64).T
        assert got.dtype == np.float32 and got.shape == (rows, shape[0])
        assert np.all(np.abs(got - ref) <= 2e-6 * bound + 1e-30), shape


@pytest.mark.parametrize("compact", [False, True], ids=["int8", "compact"])
def test_rows_do_not_depend_on_the_batch(compact, rng, cpu_isa):
    """Row i's result is bit-identical alone, in any batch size, at any position (other
    register tiles, other blocks of rows), and across runs (threads take items in any order);
    5-bit panels (unpacked in registers up to 6 rows, per item past that) give the int8
    panels' bits."""
    w, _ = _weight(rng, "Q4_K", (1024, 1024), compact=compact)
    assert kernel.is_q5(w.qweight) == compact
    x = jnp.asarray(rng.standard_normal((150, 1024)).astype(np.float32))
    full = _call(x, w, cpu_isa)
    np.testing.assert_array_equal(_call(x, w, cpu_isa), full)
    for lo, hi in [(0, 1), (3, 4), (0, 2), (5, 13), (9, 17), (63, 66), (60, 150), (149, 150)]:
        np.testing.assert_array_equal(_call(x[lo:hi], w, cpu_isa), full[lo:hi])
    if compact:
        rows = GGUFWeight(*(None if a is None else kernel.unpack(a) for a in w))
        int8 = GGUFWeight(*(None if a is None else jnp.asarray(b) for a, b in zip(
            w, kernel.pack(*(None if a is None else np.asarray(a) for a in rows)), strict=True)))
        assert not kernel.is_q5(int8.qweight)
        for lo, hi in [(0, 1), (0, 5), (0, 6), (0, 7), (0, 150)]:
            np.testing.assert_array_equal(_call(x[lo:hi], int8, cpu_isa), full[lo:hi])


@pytest.mark.skipif(not cpu_ffi.runs_here("avx2"), reason="this CPU cannot run the avx2 build")
@pytest.mark.parametrize("compact", [False, True], ids=["int8", "compact"])
def test_builds_give_the_same_bits(compact, rng):
    """The AVX2 build (other register tiles, no in-register 5-bit unpacking) gives the native
    build's results bit for bit: every format, panel width and row tile."""
    for fmt in FORMATS:
        for shape in ((1008, 256), (96, 512), (128, 256)):
            w, _ = _weight(rng, fmt, shape, compact=compact)
            for rows in (1, 2, 3, 5, 6, 7, 13, 70):
                x = jnp.asarray(rng.standard_normal((rows, shape[1])).astype(np.float32))
                np.testing.assert_array_equal(_call(x, w, "avx2"), _call(x, w, "native"))


def test_packing_moves_values_only(rng):
    """pack then unpack gives the rows back, and the packed weight dequantizes (whole, or a
    gather of rows as the embedding does) to gguf's values; widths no panel divides are
    refused by name."""
    raw = random_blocks(rng, "Q4_K", 48, 256)
    want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_K).reshape(48, 256)
    r = gguf_repack.repack(raw, "Q4_K", (48, 256), "t")
    packed = kernel.pack(r.qweight, r.scale, r.offset)
    assert packed[0].shape == (3, 256, 16) and packed[1].shape == (3, 8, 16)
    for a, b in zip(packed, (r.qweight, r.scale, r.offset), strict=True):
        np.testing.assert_array_equal(kernel.unpack(a), b)
    w = GGUFWeight(*map(jnp.asarray, packed))
    assert w.packed and w.shape == (48, 256) and w.block_size == 32
    np.testing.assert_array_equal(np.asarray(dequantize(w)), want)
    rows = jnp.asarray([0, 17, 47, 17, 31])
    np.testing.assert_array_equal(np.asarray(jax.jit(dequantize)(w, rows)), want[rows])
    with pytest.raises(ValueError, match=r"out \(40\) must be a multiple of 16"):
        kernel.pack(r.qweight[:40], r.scale[:40], r.offset[:40])


@pytest.mark.parametrize("fmt", ["Q5_0", "Q8_0"])
def test_five_bit_panels_move_values_only(fmt, rng):
    """Values in -16..15 in panels of 64 pack into 5-bit panels (40 bytes per k for 64
    weights) and come back exactly, whole or as gathered rows; Q8_0's do not fit and stay
    int8."""
    raw = random_blocks(rng, fmt, 192, 256)
    want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[fmt]).reshape(192, 256)
    r = gguf_repack.repack(raw, fmt, (192, 256), "t")
    packed = kernel.pack(r.qweight, r.scale, r.offset, compact=True)
    if fmt == "Q8_0":
        assert packed[0].dtype == np.int8 and packed[0].shape == (3, 256, 64)
        return
    narrow = kernel.pack(r.qweight[:48], r.scale[:48], r.offset, compact=True)  # panels of 16
    assert narrow[0].dtype == np.int8 and narrow[0].shape == (3, 256, 16)
    assert packed[0].dtype == np.uint8 and packed[0].shape == (3, 256, kernel.Q5_BYTES)
    assert packed[0].nbytes * 64 == r.qweight.nbytes * kernel.Q5_BYTES
    np.testing.assert_array_equal(kernel.unpack(packed[0]), r.qweight)
    np.testing.assert_array_equal(np.asarray(kernel.unpack(jnp.asarray(packed[0]))), r.qweight)
    w = GGUFWeight(*(None if a is None else jnp.asarray(a) for a in packed))
    assert w.packed and w.shape == (192, 256)
    np.testing.assert_array_equal(np.asarray(dequantize(w)), want)
    rows = jnp.asarray([0, 1, 31, 32, 33, 63, 64, 127, 128, 191, 32])
    np.testing.assert_array_equal(np.asarray(jax.jit(dequantize)(w, rows)), want[rows])


@pytest.mark.skipif(platform.machine() != "x86_64", reason="-mno-avx512vbmi is an x86 flag")
def test_five_bit_panels_without_avx512_vbmi(rng, tmp_path):
    """The kernel built without AVX-512 VBMI unpacks 5-bit panels with its portable code (in
    registers for a few rows, into the buffer for more): the same results bit for bit as the
    int8 panels of the same values (a portable build registered under a name of its own)."""
    lib = ctypes.cdll.LoadLibrary(str(cpu_ffi.build(
        kernel.SOURCE, tmp_path, extra_flags=("-mno-avx512vbmi",))))
    jax.ffi.register_ffi_target("test_dequant_matmul_q5_portable",
                                jax.ffi.pycapsule(lib.JaxllmDequantMatmulQ5), platform="cpu")
    for fmt in ("Q5_0", "Q4_K"):
        raw = random_blocks(rng, fmt, 128, 512)
        r = gguf_repack.repack(raw, fmt, (128, 512), "t")
        w, int8 = (GGUFWeight(*(None if a is None else jnp.asarray(a)
                                for a in kernel.pack(r.qweight, r.scale, r.offset, compact)))
                   for compact in (True, False))
        assert kernel.is_q5(w.qweight) and not kernel.is_q5(int8.qweight)
        offset = jnp.zeros((0, 0, 0), jnp.float32) if w.offset is None else w.offset
        for rows in (1, 6, 9):
            x = jnp.asarray(rng.standard_normal((rows, 512)).astype(np.float32))
            portable = jax.ffi.ffi_call("test_dequant_matmul_q5_portable",
                                        jax.ShapeDtypeStruct((rows, 128), jnp.float32))(
                x, w.qweight, w.scale, offset, has_offset=w.offset is not None)
            np.testing.assert_array_equal(np.asarray(portable), _call(x, int8))


def test_bad_shapes_are_named(rng):
    w, _ = _weight(rng, "Q8_0", (16, 64))
    with pytest.raises(ValueError, match=r"dequant_matmul: x \[T, in\] has in=32, qweight has "
                                         r"in=64"):
        _call(jnp.ones((1, 32), jnp.float32), w)  # K mismatch, refused before the kernel
    with pytest.raises(ValueError, match=r"must be 3-D; qweight has shape \(16, 64\)"):
        _call(jnp.ones((1, 64), jnp.float32), GGUFWeight(kernel.unpack(w.qweight),
                                                         kernel.unpack(w.scale), None))


def test_gguf_linear_uses_the_kernel_and_falls_back_to_xla(rng):
    """gguf_linear runs the kernel on a packed weight (a custom call in the compiled HLO) and
    XLA's fused GEMVs on rows (the layout loaded where the kernel is unavailable): the same
    values up to summation order."""
    w, want = _weight(rng, "Q4_K", (64, 512))
    x = jnp.asarray(rng.standard_normal((4, 512)).astype(np.float32))
    text = jax.jit(gguf_linear).lower(x, w).as_text()
    assert "jaxllm_dequant_matmul" in text
    fast = np.asarray(jax.jit(gguf_linear)(x, w))
    rows = GGUFWeight(*(None if a is None else kernel.unpack(a) for a in w))  # XLA's layout
    xla = jax.jit(gguf_linear)
    assert "jaxllm_dequant_matmul" not in xla.lower(x, rows).as_text()
    slow = np.asarray(xla(x, rows))
    ref = np.asarray(x, np.float64) @ want.astype(np.float64).T
    for got in (fast, slow):
        np.testing.assert_allclose(got, ref, rtol=0, atol=1e-5 * np.abs(ref).max())


def test_build_is_cached_and_errors_are_named(tmp_path):
    lib = cpu_ffi.build(kernel.SOURCE, tmp_path)
    mtime = lib.stat().st_mtime_ns
    assert cpu_ffi.build(kernel.SOURCE, tmp_path) == lib and lib.stat().st_mtime_ns == mtime
    bad = tmp_path / "bad.cc"
    bad.write_text("this is not C++\n")
    with pytest.raises(cpu_ffi.KernelBuildError, match="failed"):
        cpu_ffi.build(bad, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([lib.name, "bad.cc"])


def test_disabled_by_environment(monkeypatch):
    """$JAXLLM_CPU_KERNELS=0 turns them off (read once per process: the uncached function
    here)."""
    monkeypatch.setenv(cpu_ffi.DISABLE_ENV_VAR, "0")
    assert kernel._available.__wrapped__("native") is False
    monkeypatch.setenv(cpu_ffi.DISABLE_ENV_VAR, "1")
    assert kernel._available.__wrapped__("native") is True
