"""The fused int8-block dequant matmul kernel (pallas_kernels/dequant_matmul.py) against its
reference: both variants (GEMV under 16 rows, tiled GEMM from 16), ragged row, output and K
counts, 16- and 32-value blocks with and without offsets, float32 and bfloat16 activations.

The reference itself is checked against numpy's float64 product of gguf_repack's exact
dequantization, so the kernel is tied to GGUF's values, not only to another JAX expression.
CUDA lowering and sm_90a compilation of the kernel at Qwen2.5 shapes are in test_lowering.py and
test_compile.py (it is in checks.check_lowering.KERNEL_MODULES)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.model_executor.model_loader import gguf_repack
from pallas_kernels.checks.lowering_cases import matmul_shape
from pallas_kernels.checks.shapes import QWEN2_SHAPES
from pallas_kernels.dequant_matmul import (
    GEMM_MIN_ROWS,
    dequant_matmul,
    dequant_matmul_reference,
    launch_config,
)
from tests.gguf_models import quantized_bytes
from tests.kernel_backends import KERNEL_BACKENDS


def _weights(rng, n: int, k: int, group: int, with_offset: bool):
    q = rng.integers(-128, 128, (n, k)).astype(np.int8)
    scale = (rng.standard_normal((n, k // group)) * 0.01).astype(np.float32)
    offset = (rng.standard_normal((n, k // group)) * 0.01).astype(np.float32) \
        if with_offset else None
    return q, scale, offset


def _assert_close(got, want, x, w, dtype) -> None:
    """float32: sum-order rounding only. bfloat16: each product may carry the weight's rounding
    to bfloat16 (2^-8 relative; XLA on CPU may keep the excess precision in interpret mode,
    its `xla_allow_excess_precision`) and the result its own rounding to bfloat16."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    scale = np.abs(np.asarray(x, np.float64)) @ np.abs(np.asarray(w, np.float64)).T
    if dtype == jnp.float32:
        bound = 1e-6 * scale + 1e-6
    else:
        bound = 2.0 ** -8 * scale + 2.0 ** -7 * np.abs(want) + 1e-6
    excess = np.abs(got - want) - bound
    assert (excess <= 0).all(), f"max error over the bound: {excess.max()} at " \
                                f"{np.unravel_index(excess.argmax(), excess.shape)}"


# (M, N, K, group, offset): M on both sides of GEMM_MIN_ROWS and ragged against every tile;
# N not a multiple of any tile (the GEMV's narrowest is 4); K a multiple of the block but not
# of the K tile (160, 96).
SHAPES = [(1, 70, 96, 32, True), (3, 38, 64, 16, False), (7, 102, 160, 16, True),
          (16, 70, 96, 32, False), (17, 70, 96, 32, True), (33, 102, 160, 16, True),
          (70, 38, 256, 32, False)]


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("m,n,k,group,with_offset", SHAPES)
def test_kernel_matches_reference(backend, dtype, m, n, k, group, with_offset, rng):
    q, scale, offset = _weights(rng, n, k, group, with_offset)
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    args = (x, jnp.asarray(q), jnp.asarray(scale), None if offset is None else jnp.asarray(offset))
    got = dequant_matmul(*args, backend=backend)
    want = dequant_matmul(*args, backend="reference")
    assert got.shape == (m, n) and got.dtype == dtype
    w = gguf_repack.dequantize(gguf_repack.RepackedBlocks(q, scale, offset))
    _assert_close(got, want, x, w, dtype)
    # Rows are independent: the last row alone (the GEMV when the batch ran the GEMM) gives its
    # row of the batch, to rounding (the two sum in different orders).
    lone = dequant_matmul(x[m - 1:], *args[1:], backend=backend)
    _assert_close(lone, want[m - 1:], x[m - 1:], w, dtype)


@pytest.mark.parametrize("m", [1, 8, 64])
def test_at_a_qwen_shape(m, rng):
    """Qwen2.5-0.5B's fused q/k/v shape (N 1152, K 896, Q4_K-like blocks), bfloat16: the GEMV's
    narrow columns and the GEMM's SM-filling narrowing at real sizes."""
    (n, k), group = matmul_shape(QWEN2_SHAPES["qwen2.5-0.5b"], "qkv"), 32
    assert (n, k) == (1152, 896)
    q, scale, offset = _weights(rng, n, k, group, True)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    args = (x, jnp.asarray(q), jnp.asarray(scale), jnp.asarray(offset))
    assert launch_config(m, n, k, jnp.bfloat16)["block_n"] == (4 if m < 16 else 16)
    got = dequant_matmul(*args, backend="interpret")
    w = gguf_repack.dequantize(gguf_repack.RepackedBlocks(q, scale, offset))
    _assert_close(got, dequant_matmul(*args), x, w, jnp.bfloat16)


@pytest.mark.parametrize("fmt", ["Q4_K", "Q6_K", "Q8_0"])
def test_reference_is_gguf_exact_product(fmt, rng):
    """The reference multiplies gguf's exact dequantized values (float32 activations)."""
    n, k = 24, 256
    r = gguf_repack.repack(quantized_bytes(rng, fmt, n, k), fmt, (n, k))
    x = rng.standard_normal((5, k)).astype(np.float32)
    want = x.astype(np.float64) @ gguf_repack.dequantize(r).astype(np.float64).T
    for backend in ("reference", "interpret"):
        got = dequant_matmul(jnp.asarray(x), jnp.asarray(r.qweight), jnp.asarray(r.scale),
                             None if r.offset is None else jnp.asarray(r.offset),
                             backend=backend)
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def test_bfloat16_rounds_the_weight_and_returns_out_dtype(rng):
    q, scale, offset = _weights(rng, 8, 64, 32, True)
    x = jnp.asarray(rng.standard_normal((2, 64)), jnp.bfloat16)
    w = gguf_repack.dequantize(gguf_repack.RepackedBlocks(q, scale, offset))
    w_bf16 = np.asarray(jnp.asarray(w).astype(jnp.bfloat16), np.float64)
    want = np.asarray(x, np.float64) @ w_bf16.T
    got = dequant_matmul_reference(x, jnp.asarray(q), jnp.asarray(scale), jnp.asarray(offset),
                                   out_dtype=jnp.float32)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    for rows in (2, 16):  # the GEMV and the GEMM
        xr = jnp.asarray(rng.standard_normal((rows, 64)), jnp.bfloat16)
        kernel = dequant_matmul(xr, jnp.asarray(q), jnp.asarray(scale), jnp.asarray(offset),
                                out_dtype=jnp.float32, backend="interpret")
        _assert_close(kernel, np.asarray(xr, np.float64) @ w_bf16.T, xr, w, jnp.bfloat16)


def test_launch_config_picks_the_variant_by_rows():
    assert "block_m" not in launch_config(GEMM_MIN_ROWS - 1, 896, 896, jnp.bfloat16)
    gemm = launch_config(GEMM_MIN_ROWS, 896, 896, jnp.bfloat16)
    assert gemm["block_m"] == 16 and gemm["block_k"] == 64
    assert launch_config(2048, 896, 896, jnp.float32)["block_m"] == 32
    # The GEMV narrows its tile to keep the SMs busy on a narrow matrix.
    gemv = launch_config(1, 1152, 896, jnp.bfloat16)
    assert -(-1152 // gemv["block_n"]) >= 264


def test_bad_arguments_are_named():
    x = jnp.zeros((2, 64), jnp.float32)
    q = jnp.zeros((8, 64), jnp.int8)
    s = jnp.zeros((8, 2), jnp.float32)
    with pytest.raises(ValueError, match="columns"):
        dequant_matmul(jnp.zeros((2, 32), jnp.float32), q, s)
    with pytest.raises(ValueError, match="int8"):
        dequant_matmul(x, q.astype(jnp.int32), s)
    with pytest.raises(ValueError, match="whole blocks"):
        dequant_matmul(x, q, jnp.zeros((8, 3), jnp.float32))
    with pytest.raises(ValueError, match="offset"):
        dequant_matmul(x, q, s, jnp.zeros((8, 4), jnp.float32))
    with pytest.raises(ValueError, match="bfloat16 or float32"):
        dequant_matmul(x.astype(jnp.float16), q, s)
    with pytest.raises(ValueError, match="unknown backend"):
        dequant_matmul(x, q, s, backend="cuda")
    assert dequant_matmul(x[:0], q, s, backend="interpret").shape == (0, 8)
