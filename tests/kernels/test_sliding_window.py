"""Sliding-window attention (``sliding_window`` W: a query at p sees keys p - W + 1..p, as
Hugging Face's masks) on every attention implementation against the naive float64 model:
the reference inside an engine-like bucket and with tiles small enough that windows start and
end mid-tile, the Pallas kernel (interpret mode; native on a GPU), split-K decode and the CPU
kernel. Windows from one key to longer than the context; prefill chunks on cached context,
decodes and padding in one step. The window a model gives each layer is tested against
transformers in tests/model/test_model_families.py."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxllm.model_executor.layers import cpu_attention
from pallas_kernels import reference_attention
from pallas_kernels.paged_attention import paged_attention
from tests.attention_cases import make_case, pad_case
from tests.kernel_backends import KERNEL_BACKENDS

# Fresh prefills, chunks on cached context, decodes deep into the context, a padding sequence.
SEQS = [(30, 40), (5, 1), (0, 70), (150, 1), (50, 2), (0, 3), (133, 20), (0, 0), (64, 1)]
WINDOWS = [1, 5, 16, 37, 100, 400]  # 400: longer than every context, no key masked


def _case(window, seed=0, **kw):
    return make_case(SEQS, pad_tokens=3, pad_seqs=1, seed=seed, sliding_window=window, **kw)


def _check(case, out, tol=1e-5):
    out = np.asarray(out)
    total = int(case.qsl[-1])
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out[:total], case.expected()[:total], rtol=tol, atol=tol)
    assert (out[total:] == 0).all()


@pytest.mark.parametrize("window", WINDOWS)
def test_reference(window):
    case = _case(window, seed=window)
    _check(case, case.run("reference"))
    # Inside a bucket (padding tokens, sequence slots, a wide table) as the engine runs it.
    _check(case, pad_case(case, num_tokens=256, num_seqs=16, width=64, num_blocks=128)
           .run("reference", max_query_len=256))


def test_reference_small_tiles(monkeypatch):
    # Key tiles of one block, token groups of two, query tiles of three: windows start in the
    # middle of tiles and tiles straddle window starts in every loop.
    monkeypatch.setattr(reference_attention, "_REF_KEY_TILE", 16)
    monkeypatch.setattr(reference_attention, "_REF_TOKEN_GROUP", 2)
    monkeypatch.setattr(reference_attention, "_REF_QUERY_TILE", 3)
    for window in (7, 33):
        case = _case(window, seed=3)
        fn = jax.jit(lambda *a, w=window, c=case: paged_attention(
            *a[:2], c.layer, *a[3:], scale=c.scale, max_query_len=c.max_query_len,
            sliding_window=w))
        _check(case, fn(*case.args()))


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("window,block_size", [(1, 16), (5, 32), (37, 16), (100, 16)])
def test_kernel(backend, window, block_size):
    case = _case(window, seed=window, block_size=block_size)
    _check(case, case.run(backend))


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("window", [1, 20, 100])
def test_split_k_decode(backend, window):
    # Decodes whose windows start before, at and after split boundaries; 16 splits of a
    # window of one key leave all but one split empty.
    case = make_case([(n - 1, 1) for n in (1, 16, 64, 65, 200, 333)] + [(0, 0)], pad_tokens=2,
                     pad_seqs=1, seed=window, sliding_window=window)
    for num_splits in (4, 16):
        _check(case, case.run(backend, max_query_len=1, num_splits=num_splits))


def test_window_argument_checks():
    case = _case(None)
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="sliding_window must be a positive integer"):
            paged_attention(*case.args(), scale=case.scale, sliding_window=bad)


@pytest.mark.skipif(jax.default_backend() != "cpu" or not cpu_attention.available(),
                    reason="the CPU kernel runs on JAX's CPU backend and needs a C++ compiler")
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("head_dim,block_size", [(64, 16), (128, 32)])
def test_cpu_kernel(window, head_dim, block_size):
    case = _case(window, seed=window + head_dim, head_dim=head_dim, block_size=block_size)
    _check(case, cpu_attention.paged_attention(*case.args(), scale=case.scale,
                                               sliding_window=window), tol=2e-5)
