"""The CPU kernel's opt-in integer path (cpu_dequant_matmul.int8_matmul, the engine's
cpu_int8_activations): activations quantized to int8 per block of 32, integer dot products
against the GGUF values (AVX-512 VNNI, AVX2 maddubs), for the native build and the AVX2 one.

Two oracles: a float64 numpy matmul of the same quantized activations (quantized here as the
kernel does, bit for bit) with the same blocks' weights, which the kernel must match to float32
rounding; and the exact path, from which it may differ by no more than the activations'
rounding allows: each x moves by at most half its block's step (max |x| / 254), so
|int8 - exact| <= sum_k |w[n, k]| * max |x| of k's block / 254, checked element by element.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.model_executor.layers.quantization import cpu_dequant_matmul as kernel
from jaxllm.model_executor.layers.quantization.gguf import GGUFWeight, dequantize, gguf_linear
from jaxllm.model_executor.model_loader import gguf_repack
from tests.gguf_models import random_blocks

if jax.default_backend() != "cpu":
    pytest.skip("the CPU kernel runs on JAX's CPU backend", allow_module_level=True)
if not kernel.available():
    pytest.skip("no C++ compiler to build the CPU kernel", allow_module_level=True)
if not kernel.int8_supported():
    pytest.skip("the integer path needs x86 with AVX2", allow_module_level=True)

FORMATS = ["Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q5_0", "Q4_0"]
QUANT_BLOCK = 32


def quantize_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The kernel's activation quantization in float32 numpy: per block of 32, d = max |x| /
    127, xq = round-half-even(x * (1 / d)). -> (xq int [T, K], d [T, K / 32])."""
    t, k = x.shape
    xb = x.reshape(t, k // QUANT_BLOCK, QUANT_BLOCK)
    d = (np.abs(xb).max(-1) / np.float32(127)).astype(np.float32)
    inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d != 0)
    xq = np.clip(np.rint(xb * inv[..., None]), -127, 127)
    return xq.reshape(t, k).astype(np.int64), d


def _float64(q: np.ndarray, scale: np.ndarray, offset: np.ndarray | None) -> np.ndarray:
    """q [out, in] * scale (+ offset) per block, in float64."""
    out, cols = q.shape
    w = q.reshape(out, scale.shape[1], -1) * scale[..., None].astype(np.float64)
    if offset is not None:
        w = w + offset[..., None].astype(np.float64)
    return w.reshape(out, cols)


def _weight(rng, fmt: str, shape: tuple[int, int]):
    """(the int8 path's GGUFWeight, float64 weights [out, in] of its blocks (the float16
    scales), the repacked blocks)."""
    r = gguf_repack.repack(random_blocks(rng, fmt, *shape), fmt, shape, "t")
    packed = kernel.pack_int8(r.qweight, r.scale, r.offset)
    w64 = _float64(*(None if a is None else kernel.unpack(a) for a in packed))
    return GGUFWeight(*(None if a is None else jnp.asarray(a) for a in packed)), w64, r


@functools.cache
def _jitted(isa: str):
    return jax.jit(functools.partial(kernel.int8_matmul, isa=isa))


def _call(x, w: GGUFWeight, isa: str) -> np.ndarray:
    return np.asarray(_jitted(isa)(jnp.asarray(x), w.qweight, w.scale, w.offset))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 17, 70])
def test_matches_float64_of_the_quantized_activations(fmt, rows, rng, cpu_isa):
    """Against float64 sum_k (d * xq)[t, k] * w[n, k]: float32 rounding only (the integer
    sums are exact; the scales' products and the blocks' float32 sum round), for panels of 64
    (nibble-packed where the values take 4 to 6 bits), 32 and 16 features (bytes) and tiles of
    every row count (one row, two with AVX-512, unpack a nibble-packed quad in registers; more
    unpack a panel at once)."""
    for out, cols in ((128, 256), (96, 512), (48, 256)):
        w, w64, _ = _weight(rng, fmt, (out, cols))
        x = rng.standard_normal((rows, cols)).astype(np.float32)
        x[0, :QUANT_BLOCK] = 0.0  # a block of zeros: d = 0
        xq, d = quantize_rows(x)
        xhat = xq * np.repeat(d, QUANT_BLOCK, axis=1).astype(np.float64)
        want = xhat @ w64.T
        bound = np.abs(xhat) @ np.abs(w64.T)
        got = _call(x, w, cpu_isa)
        assert np.all(np.abs(got - want) <= 2e-6 * bound + 1e-30), \
            np.max(np.abs(got - want) / (bound + 1e-30))


@pytest.mark.parametrize("fmt", FORMATS)
def test_within_the_activation_rounding_of_the_exact_path(fmt, rng, cpu_isa):
    """Against the exact path (our float32 kernel on gguf's weights): at most the bound the
    8-bit activations and the float16 scales allow (module docstring; a scale or offset moves
    by at most 2^-11 of itself), and on random data well inside it."""
    w, w64, r = _weight(rng, fmt, (128, 512))
    exact_w = GGUFWeight(*(None if a is None else jnp.asarray(a)
                           for a in kernel.pack(r.qweight, r.scale, r.offset)))
    x = rng.standard_normal((9, 512)).astype(np.float32)
    exact = np.asarray(kernel.dequant_matmul(jnp.asarray(x), *exact_w, isa=cpu_isa))
    got = _call(x, w, cpu_isa)
    amax = np.abs(x.reshape(9, -1, QUANT_BLOCK)).max(-1)
    terms = np.abs(_float64(r.qweight, r.scale, None))
    if r.offset is not None:
        terms = terms + np.abs(_float64(np.ones_like(r.qweight), r.offset, None))
    bound = np.repeat(amax, QUANT_BLOCK, axis=1) / 254 @ np.abs(w64.T) \
        + np.abs(x) @ terms.T * 2.0 ** -11
    assert np.all(np.abs(got - exact) <= bound * (1 + 1e-4) + 1e-6)
    assert np.max(np.abs(got - exact)) <= 0.02 * np.max(np.abs(exact))


def test_rows_do_not_depend_on_the_batch(rng, cpu_isa):
    """Each row is quantized on its own and every tile does the same arithmetic per row, so a
    row's result is bit-identical alone or among others."""
    w, _, _ = _weight(rng, "Q6_K", (128, 512))
    x = rng.standard_normal((13, 512)).astype(np.float32)
    full = _call(x, w, cpu_isa)
    for lo, hi in ((0, 1), (3, 4), (2, 7), (5, 13)):
        np.testing.assert_array_equal(_call(x[lo:hi], w, cpu_isa), full[lo:hi])


def test_nan_and_inf_activations_reach_the_rows_they_are_in(rng, cpu_isa):
    """A NaN or an infinity in a row gives that row non-finite results, as the exact path
    does, and leaves the other rows alone."""
    w, _, _ = _weight(rng, "Q5_0", (64, 256))
    x = rng.standard_normal((3, 256)).astype(np.float32)
    x[0, 40], x[2, 200] = np.nan, np.inf
    got = _call(x, w, cpu_isa)
    assert not np.isfinite(got[0]).any() and not np.isfinite(got[2]).any()
    np.testing.assert_array_equal(got[1], _call(x[1:2], w, cpu_isa)[0])


def test_builds_agree(rng):
    """Native (VNNI here where the CPU has it) and AVX2 builds: the same integer sums, the
    same float32 operations per block, so the same bits."""
    builds = [isa for isa in ("native", "avx2") if kernel.int8_supported(isa)]
    if len(builds) < 2 or not kernel.available("avx2"):
        pytest.skip("one build with the integer path here")
    for fmt in ("Q8_0", "Q5_0"):  # bytes, nibble-packed
        w, _, _ = _weight(rng, fmt, (64, 256))
        for rows in (1, 3):
            x = rng.standard_normal((rows, 256)).astype(np.float32)
            results = [_call(x, w, isa) for isa in builds]
            for other in results[1:]:
                np.testing.assert_array_equal(other, results[0])


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("out", [128, 96])
def test_packing_moves_values_only(fmt, out, rng):
    """pack_int8: panels of 64 whose values take 4 to 6 bits nibble-packed (signed formats
    stored as q + 2^(bits - 1), marked int8), other panels bytes with 4 consecutive k of a
    feature side by side (unsigned, q + zero with the zero folded into the offset exactly, but
    Q8_0's, which stay signed); scales float16. The GGUFWeight reads back as the same weight
    (unpacked for dequantize and row gathers)."""
    w, w64, r = _weight(rng, fmt, (out, 256))
    values, scale, offset = (np.asarray(a) if a is not None else None for a in w)
    bits = {"Q4_K": 4, "Q4_0": 4, "Q5_K": 5, "Q5_0": 5, "Q6_K": 6}.get(fmt, 8)
    assert scale.dtype == np.float16 and (offset is None or offset.dtype == np.float16)
    if out % 64 == 0 and bits < 8:
        assert values.shape == (out // 64, 256 // 4, 128 + 32 * (bits - 4))
        assert values.dtype == (np.uint8 if fmt in ("Q4_K", "Q5_K") else np.int8)
        assert kernel.int8_zero(values) == (0 if fmt in ("Q4_K", "Q5_K") else 1 << (bits - 1))
        np.testing.assert_array_equal(kernel.unpack(values), r.qweight)
        assert (offset is None) == (r.offset is None)
    else:
        p = kernel.panel_size(out)
        assert values.shape == (out // p, 256 // 4, p, 4)
        assert values.dtype == (np.int8 if fmt == "Q8_0" else np.uint8)
        rows = values.transpose(0, 2, 1, 3).reshape(out, 256).astype(np.int64)
        zero = int(rows.min() - r.qweight.min())
        np.testing.assert_array_equal(rows - zero, r.qweight)
        assert zero in (0, 8, 16, 32)
        assert rows.max() <= kernel.INT8_MAX or fmt == "Q8_0"
        if zero:
            np.testing.assert_array_equal(
                kernel.unpack(offset), (r.scale * np.float32(-zero)).astype(np.float16))
    np.testing.assert_array_equal(kernel.unpack(scale), r.scale.astype(np.float16))
    assert w.shape == (out, 256) and w.block_size == r.block_size and w.int8
    np.testing.assert_allclose(np.asarray(dequantize(w)), w64, rtol=1e-6, atol=1e-7)
    take = jnp.asarray([0, out - 1, 33])
    np.testing.assert_allclose(np.asarray(dequantize(w, take)), w64[np.asarray(take)],
                               rtol=1e-6, atol=1e-7)


def test_nibble_layout_bytes():
    """The nibble-packed layout's bytes as documented: per quad of a 64-feature panel (values
    f * 4 + j for feature f, k = 4 quad + j), byte i holds value i's low nibble and value
    i + 128's in its high half, and plane p's byte i has value 32 b + i's bit 4 + p in bit b."""
    q = np.arange(64 * 32, dtype=np.int64).reshape(64, 32) % 61 - 30  # -30..30: 6 bits, signed
    values, _, _ = kernel.pack_int8(q.astype(np.int8), np.ones((64, 1), np.float32), None)
    assert values.shape == (1, 8, 192) and values.dtype == np.int8
    stored = (q + 32).reshape(64, 8, 4).transpose(1, 0, 2).reshape(8, 256)  # per quad, f * 4 + j
    raw = values.view(np.uint8)
    for quad in range(8):
        for i in range(128):
            assert raw[0, quad, i] == (stored[quad, i] & 15) | (stored[quad, i + 128] & 15) << 4
        for plane in range(2):
            for i in range(32):
                want = sum(((stored[quad, 32 * b + i] >> (4 + plane)) & 1) << b for b in range(8))
                assert raw[0, quad, 128 + 32 * plane + i] == want


@pytest.mark.parametrize("rows_each", [64, 48])
def test_signed_values_with_offsets(rows_each, rng, cpu_isa):
    """Fused rows of a signed format and one with offsets (Q6_K beside Q4_K, as a qkv
    projection may be): nibble-packed with both the zero and the offsets in panels of 64,
    signed bytes with the offsets in narrower ones; either way they match float64."""
    parts = [gguf_repack.repack(random_blocks(rng, fmt, rows_each, 256), fmt, (rows_each, 256),
                                "t") for fmt in ("Q6_K", "Q4_K")]
    r = gguf_repack.concat_rows(parts)
    assert r.offset is not None and r.qweight.min() < 0
    packed = kernel.pack_int8(r.qweight, r.scale, r.offset)
    w = GGUFWeight(*(None if a is None else jnp.asarray(a) for a in packed))
    assert w.qweight.dtype == jnp.int8 and w.qweight.ndim == (3 if rows_each == 64 else 4)
    assert w.offset is not None and kernel.int8_zero(w.qweight) == (32 if rows_each == 64 else 0)
    w64 = _float64(*(kernel.unpack(a) for a in packed))
    np.testing.assert_array_equal(kernel.unpack(packed[0]), r.qweight)
    x = rng.standard_normal((5, 256)).astype(np.float32)
    xq, d = quantize_rows(x)
    xhat = xq * np.repeat(d, QUANT_BLOCK, axis=1).astype(np.float64)
    for rows in (1, 5):  # in registers, a panel unpacked
        got = _call(x[:rows], w, cpu_isa)
        want = xhat[:rows] @ w64.T
        assert np.all(np.abs(got - want) <= 2e-6 * (np.abs(xhat[:rows]) @ np.abs(w64.T)))


def test_scales_that_float16_cannot_hold_are_refused(rng):
    """The integer path's scales are float16: one past its range, or below its normal range
    where rounding would move it by more than 2^-11 of itself, is refused by name (the loader
    turns it into a ModelLoadError); zeros and float16's own subnormals pass unchanged."""
    q = rng.integers(-16, 16, (64, 64)).astype(np.int8)
    for bad in (1e6, 3e-6):
        scale = np.full((64, 2), 0.01, np.float32)
        scale[5, 1] = bad
        with pytest.raises(ValueError, match="float16"):
            kernel.pack_int8(q, scale, None)
    scale = np.full((64, 2), 0.01, np.float32)
    scale[0, 0], scale[1, 1] = 0.0, np.float32(np.float16(3e-6))  # exact in float16
    _, half, _ = kernel.pack_int8(q, scale, None)
    np.testing.assert_array_equal(kernel.unpack(half).astype(np.float32)[:2],
                                  scale.astype(np.float16).astype(np.float32)[:2])


def test_float32_scales_are_refused(rng):
    w, _, r = _weight(rng, "Q5_0", (64, 256))
    with pytest.raises(ValueError, match="float16"):
        kernel.int8_matmul(jnp.zeros((1, 256)), w.qweight, w.scale.astype(jnp.float32), None)


def test_gguf_linear_dispatches_and_bad_shapes_are_named(rng):
    w, w64, _ = _weight(rng, "Q4_K", (64, 256))
    x = rng.standard_normal((2, 256)).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(jax.jit(gguf_linear)(jnp.asarray(x), w)),
                                  _call(x, w, "native"))
    with pytest.raises(ValueError, match="int8_matmul"):
        kernel.int8_matmul(jnp.zeros((2, 128)), w.qweight, w.scale, w.offset)
    with pytest.raises(ValueError, match="multiple"):
        kernel.pack_int8(np.zeros((64, 48), np.int8), np.ones((64, 3), np.float32), None)


def test_unsupported_targets_fall_back(monkeypatch):
    """Off x86 (aarch64) there is no integer path: int8_supported is False, and the engine
    option resolves to the exact path with a warning."""
    import platform

    from jaxllm.config import resolve_cpu_int8_activations

    assert resolve_cpu_int8_activations(True, "gguf", "cpu", "reference")
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    assert not kernel.int8_supported()
    assert not resolve_cpu_int8_activations(True, "gguf", "cpu", "reference")
    assert not resolve_cpu_int8_activations(False, "gguf", "cpu", "reference")
    with pytest.raises(ValueError, match="cpu_int8_activations"):
        resolve_cpu_int8_activations(True, "none", "cpu", "reference")


@pytest.mark.parametrize("quantization, platform, backend", [
    ("gguf", "gpu", "pallas"), ("gguf", "cpu", "pallas"), ("none", "cpu", "reference")])
def test_the_option_names_what_it_needs(quantization, platform, backend):
    from jaxllm.config import resolve_cpu_int8_activations

    with pytest.raises(ValueError, match=f"{quantization!r} on {platform} with {backend!r}"):
        resolve_cpu_int8_activations(True, quantization, platform, backend)
    assert not resolve_cpu_int8_activations(False, quantization, platform, backend)


def test_the_option_excludes_compact_panels():
    from jaxllm.engine.arg_utils import EngineArgs

    with pytest.raises(ValueError, match="gguf_compact and cpu_int8_activations"):
        EngineArgs(model="tiny-qwen2", gguf_compact=True,
                   cpu_int8_activations=True).create_engine_config()
