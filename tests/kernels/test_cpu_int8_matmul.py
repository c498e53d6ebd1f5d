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


def _weight(rng, fmt: str, shape: tuple[int, int]):
    """(the int8 path's GGUFWeight, float64 weights [out, in] of the same blocks)."""
    r = gguf_repack.repack(random_blocks(rng, fmt, *shape), fmt, shape, "t")
    w = r.qweight.reshape(shape[0], -1, r.block_size) * r.scale[..., None].astype(np.float64)
    if r.offset is not None:
        w = w + r.offset[..., None]
    packed = kernel.pack_int8(r.qweight, r.scale, r.offset)
    return GGUFWeight(*(None if a is None else jnp.asarray(a) for a in packed)), \
        w.reshape(shape), r


@functools.cache
def _jitted(isa: str):
    return jax.jit(functools.partial(kernel.int8_matmul, isa=isa))


def _call(x, w: GGUFWeight, isa: str) -> np.ndarray:
    return np.asarray(_jitted(isa)(jnp.asarray(x), w.qweight, w.scale, w.offset))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 17, 70])
def test_matches_float64_of_the_quantized_activations(fmt, rows, rng, cpu_isa):
    """Against float64 sum_k (d * xq)[t, k] * w[n, k]: float32 rounding only (the integer
    sums are exact; the scales' products and the blocks' float32 sum round), for panels of 64,
    32 and 16 features and tiles of every row count."""
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
    8-bit activations allow (module docstring), and on random data well inside it."""
    w, w64, r = _weight(rng, fmt, (128, 512))
    exact_w = GGUFWeight(*(None if a is None else jnp.asarray(a)
                           for a in kernel.pack(r.qweight, r.scale, r.offset)))
    x = rng.standard_normal((9, 512)).astype(np.float32)
    exact = np.asarray(kernel.dequant_matmul(jnp.asarray(x), *exact_w, isa=cpu_isa))
    got = _call(x, w, cpu_isa)
    amax = np.abs(x.reshape(9, -1, QUANT_BLOCK)).max(-1)
    bound = np.repeat(amax, QUANT_BLOCK, axis=1) / 254 @ np.abs(w64.T)
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


def test_builds_agree(rng):
    """Native (VNNI here where the CPU has it) and AVX2 builds: the same integer sums, the
    same float32 operations per block, so the same bits."""
    w, _, _ = _weight(rng, "Q8_0", (64, 256))
    x = rng.standard_normal((3, 256)).astype(np.float32)
    builds = [isa for isa in ("native", "avx2") if kernel.int8_supported(isa)]
    results = [_call(x, w, isa) for isa in builds]
    for other in results[1:]:
        np.testing.assert_array_equal(other, results[0])


@pytest.mark.parametrize("fmt", FORMATS)
def test_packing_moves_values_only(fmt, rng):
    """pack_int8: 4 consecutive k of a feature side by side; values unsigned (q + zero, the
    zero a power of two folded into the offset exactly) but Q8_0's, which stay signed; the
    GGUFWeight reads back as the same weight (unpacked for dequantize and row gathers)."""
    w, w64, r = _weight(rng, fmt, (96, 256))
    values, scale, offset = (np.asarray(a) if a is not None else None for a in w)
    assert values.shape == (96 // 32, 256 // 4, 32, 4)
    assert values.dtype == (np.int8 if fmt == "Q8_0" else np.uint8)
    rows = values.transpose(0, 2, 1, 3).reshape(96, 256).astype(np.int64)
    zero = int(rows.min() - r.qweight.min())
    np.testing.assert_array_equal(rows - zero, r.qweight)
    assert zero in (0, 8, 16, 32)
    assert rows.max() <= kernel.INT8_MAX or fmt == "Q8_0"
    if zero:
        np.testing.assert_array_equal(kernel.unpack(offset), r.scale * np.float32(-zero))
    assert w.shape == (96, 256) and w.block_size == r.block_size and w.int8
    np.testing.assert_allclose(np.asarray(dequantize(w)), w64, rtol=1e-6, atol=1e-7)
    take = jnp.asarray([0, 95, 33])
    np.testing.assert_allclose(np.asarray(dequantize(w, take)), w64[np.asarray(take)],
                               rtol=1e-6, atol=1e-7)


def test_signed_values_with_offsets(rng, cpu_isa):
    """Fused rows of a signed format and one with offsets (Q6_K beside Q4_K, as a qkv
    projection may be) keep their values signed, with the offsets, and still match float64."""
    parts = [gguf_repack.repack(random_blocks(rng, fmt, 64, 256), fmt, (64, 256), "t")
             for fmt in ("Q6_K", "Q4_K")]
    r = gguf_repack.concat_rows(parts)
    assert r.offset is not None and r.qweight.min() < 0
    w = GGUFWeight(*(None if a is None else jnp.asarray(a)
                     for a in kernel.pack_int8(r.qweight, r.scale, r.offset)))
    assert w.qweight.dtype == jnp.int8
    w64 = (r.qweight.reshape(128, -1, r.block_size) * r.scale[..., None].astype(np.float64)
           + r.offset[..., None]).reshape(128, 256)
    x = rng.standard_normal((5, 256)).astype(np.float32)
    xq, d = quantize_rows(x)
    xhat = xq * np.repeat(d, QUANT_BLOCK, axis=1).astype(np.float64)
    got = _call(x, w, cpu_isa)
    assert np.all(np.abs(got - xhat @ w64.T) <= 2e-6 * (np.abs(xhat) @ np.abs(w64.T)))


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
