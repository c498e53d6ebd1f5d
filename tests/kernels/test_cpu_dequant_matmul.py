"""The CPU fused dequant matmul kernel (jaxllm/model_executor/layers/quantization/
cpu_dequant_matmul.cc), the XLA FFI custom call quantization="gguf" runs on CPU.

Against independent oracles: the weights it forms are bit-for-bit gguf's float32 values (a unit
vector picks one weight column out exactly), its products agree with a float64 matmul of gguf's
dequantized weights, and each row's result is bit-identical whatever other rows share the call.
Also the build (cached, a compile error named) and the fallback to XLA's fused GEMVs.
"""

from __future__ import annotations

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.model_executor.layers import cpu_ffi
from jaxllm.model_executor.layers.quantization import cpu_dequant_matmul as kernel
from jaxllm.model_executor.layers.quantization.gguf import GGUFWeight, gguf_linear
from jaxllm.model_executor.model_loader import gguf_repack
from tests.gguf_models import random_blocks

if jax.default_backend() != "cpu":  # registered for XLA's CPU backend only
    pytest.skip("the CPU kernel runs on JAX's CPU backend", allow_module_level=True)
if not kernel.available():  # visible, never a silent pass: the suite's machines have g++
    pytest.skip("no C++ compiler to build the CPU kernel", allow_module_level=True)


def _weight(rng, fmt: str, shape: tuple[int, int], signed_zeros: bool = False):
    raw = random_blocks(rng, fmt, *shape, signed_zeros=signed_zeros)
    want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[fmt]).reshape(shape)
    r = gguf_repack.repack(raw, fmt, shape, "t")
    w = GGUFWeight(jnp.asarray(r.qweight), jnp.asarray(r.scale),
                   None if r.offset is None else jnp.asarray(r.offset))
    return w, want


def _call(x, w: GGUFWeight):
    return np.asarray(jax.jit(kernel.dequant_matmul)(x, w.qweight, w.scale, w.offset))


# Q4_K / Q5_K: 32-value blocks with offsets; Q6_K: 16-value blocks; Q8_0 / Q4_0: no offsets.
FORMATS = ["Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q4_0"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_weights_are_ggufs_values_bit_for_bit(fmt, rng):
    """x = unit vectors: row k of the result is column k of the weight, formed in registers
    from the int8 value and the block's scale/offset; it must be gguf's float32 value exactly
    (signed zeros of zero scales aside, which a sum cannot tell apart)."""
    w, want = _weight(rng, fmt, (48, 256), signed_zeros=True)
    cols = np.array([0, 1, 15, 16, 17, 31, 32, 100, 255])
    x = np.zeros((len(cols), 256), np.float32)
    x[np.arange(len(cols)), cols] = 1.0
    got = _call(jnp.asarray(x), w)
    np.testing.assert_array_equal(got, want[:, cols].T)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 17])
def test_matches_float64_matmul(fmt, rows, rng):
    """Every tile path against float64 numpy: weight rows in pairs (6-row tiles + remainders
    1-5) and the odd weight row of a chunk alone (8-row tiles + remainders 1-7); 41 and 73
    output rows split into chunks of odd lengths."""
    shape = (41, 4864) if fmt == "Q6_K" else (73, 512)  # down_proj's width
    w, want = _weight(rng, fmt, shape)
    x = rng.standard_normal((rows, shape[1])).astype(np.float32)
    got = _call(jnp.asarray(x), w)
    ref = x.astype(np.float64) @ want.astype(np.float64).T
    bound = np.abs(x).astype(np.float64) @ np.abs(want).astype(np.float64).T
    assert got.dtype == np.float32 and got.shape == (rows, shape[0])
    assert np.all(np.abs(got - ref) <= 2e-6 * bound + 1e-30)


def test_rows_do_not_depend_on_the_batch(rng):
    """Row i's result is bit-identical alone, in any batch size, at any position, and across
    runs (threads take chunks in any order)."""
    w, _ = _weight(rng, "Q4_K", (1001, 1024))  # several chunks per call: both threads work
    x = jnp.asarray(rng.standard_normal((17, 1024)).astype(np.float32))
    full = _call(x, w)
    np.testing.assert_array_equal(_call(x, w), full)
    for lo, hi in [(0, 1), (3, 4), (0, 2), (5, 13), (9, 17), (16, 17)]:
        np.testing.assert_array_equal(_call(x[lo:hi], w), full[lo:hi])
    # Fewer weight rows move each output between paired and single processing and across
    # chunk boundaries: its value must not move.
    for lo, hi in [(1, 1001), (0, 3), (500, 501), (7, 300)]:
        part = GGUFWeight(w.qweight[lo:hi], w.scale[lo:hi], w.offset[lo:hi])
        np.testing.assert_array_equal(_call(x[:5], part), full[:5, lo:hi])


def test_bad_shapes_are_named(rng):
    w, _ = _weight(rng, "Q8_0", (16, 64))
    with pytest.raises(ValueError, match=r"dequant_matmul: x \[T, in\] has in=32, qweight "
                                         r"\[out, in\] has in=64"):
        _call(jnp.ones((1, 32), jnp.float32), w)  # K mismatch, refused before the kernel


def test_gguf_linear_uses_the_kernel_and_falls_back_to_xla(rng, monkeypatch):
    """gguf_linear runs the kernel on CPU (a custom call in the compiled HLO, bias-free) and,
    where it is unavailable, XLA's fused GEMVs: the same values up to summation order."""
    w, want = _weight(rng, "Q4_K", (64, 512))
    x = jnp.asarray(rng.standard_normal((4, 512)).astype(np.float32))
    text = jax.jit(gguf_linear).lower(x, w).as_text()
    assert "jaxllm_dequant_matmul" in text
    fast = np.asarray(jax.jit(gguf_linear)(x, w))
    monkeypatch.setattr(kernel, "available", lambda: False)
    xla = jax.jit(lambda x, w: gguf_linear(x, w))  # a new function: jit caches traces per one
    assert "jaxllm_dequant_matmul" not in xla.lower(x, w).as_text()
    slow = np.asarray(xla(x, w))
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
    assert kernel.available.__wrapped__() is False
    monkeypatch.setenv(cpu_ffi.DISABLE_ENV_VAR, "1")
    assert kernel.available.__wrapped__() is True
