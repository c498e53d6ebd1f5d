"""The attention logit soft cap (``logits_soft_cap`` C: each scaled logit x becomes
C * tanh(x / C) before the mask and softmax, Gemma 2's) on every attention implementation
against the naive float64 model: the reference inside an engine-like bucket and with small
tiles, the Pallas kernel (interpret mode; native on a GPU), split-K decode and the CPU kernel
(its own vectorised tanh), alone and with a sliding window. The logits are scaled by 1 (not
head_dim ** -0.5) so that they reach many times the smaller caps: a cap that is not applied, or
applied to masked keys, changes the result far beyond the tolerance (checked against the
uncapped oracle). The cap a model gives its layers is tested against transformers in
tests/model/test_gemma_models.py."""

from __future__ import annotations

import dataclasses

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
CAPS = [0.5, 3.0, 30.0]


def _case(cap, window=None, seed=0, **kw):
    return make_case(SEQS, pad_tokens=3, pad_seqs=1, seed=seed, sliding_window=window,
                     logits_soft_cap=cap, scale=1.0, **kw)


def _check(case, out, tol=1e-5):
    out = np.asarray(out)
    total = int(case.qsl[-1])
    expected = case.expected()[:total]
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out[:total], expected, rtol=tol, atol=tol)
    assert (out[total:] == 0).all()
    # The cap matters at these logits: without it the oracle is far from the kernel's result.
    uncapped = dataclasses.replace(case, logits_soft_cap=None).expected()[:total]
    assert np.abs(uncapped - expected).max() > 100 * tol


@pytest.mark.parametrize("cap", CAPS)
@pytest.mark.parametrize("window", [None, 37])
def test_reference(cap, window):
    case = _case(cap, window, seed=int(cap * 10))
    _check(case, case.run("reference"))
    # Inside a bucket (padding tokens, sequence slots, a wide table) as the engine runs it.
    _check(case, pad_case(case, num_tokens=256, num_seqs=16, width=64, num_blocks=128)
           .run("reference", max_query_len=256))


def test_reference_small_tiles(monkeypatch):
    # Key tiles of one block, token groups of two, query tiles of three: masked keys inside
    # tiles, and the cap across many online-softmax steps.
    monkeypatch.setattr(reference_attention, "_REF_KEY_TILE", 16)
    monkeypatch.setattr(reference_attention, "_REF_TOKEN_GROUP", 2)
    monkeypatch.setattr(reference_attention, "_REF_QUERY_TILE", 3)
    for window in (None, 7):
        case = _case(3.0, window, seed=3)
        fn = jax.jit(lambda *a, c=case: paged_attention(
            *a[:2], c.layer, *a[3:], scale=c.scale, max_query_len=c.max_query_len,
            sliding_window=c.sliding_window, logits_soft_cap=c.logits_soft_cap))
        _check(case, fn(*case.args()))


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("cap,window,block_size", [(0.5, None, 16), (3.0, 37, 32),
                                                   (30.0, None, 32)])
def test_kernel(backend, cap, window, block_size):
    case = _case(cap, window, seed=7, block_size=block_size)
    _check(case, case.run(backend))


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("window", [None, 20])
def test_split_k_decode(backend, window):
    case = make_case([(n - 1, 1) for n in (1, 16, 64, 65, 200, 333)] + [(0, 0)], pad_tokens=2,
                     pad_seqs=1, seed=5, sliding_window=window, logits_soft_cap=3.0,
                     scale=1.0)
    for num_splits in (4, 16):
        _check(case, case.run(backend, max_query_len=1, num_splits=num_splits))


def test_soft_cap_argument_checks():
    case = _case(None)
    for bad in (0, -3.0, float("inf"), float("nan"), True, "50"):
        with pytest.raises(ValueError, match="logits_soft_cap must be a finite number > 0"):
            paged_attention(*case.args(), scale=case.scale, logits_soft_cap=bad)
        if jax.default_backend() == "cpu" and cpu_attention.available():
            with pytest.raises(ValueError, match="logits_soft_cap must be a finite number > 0"):
                cpu_attention.paged_attention(*case.args(), scale=case.scale,
                                              logits_soft_cap=bad)


@pytest.mark.skipif(jax.default_backend() != "cpu" or not cpu_attention.available(),
                    reason="the CPU kernel runs on JAX's CPU backend and needs a C++ compiler")
@pytest.mark.parametrize("cap", CAPS)
@pytest.mark.parametrize("window", [None, 5, 37])
@pytest.mark.parametrize("head_dim,block_size", [(64, 16), (128, 32)])
def test_cpu_kernel(cap, window, head_dim, block_size):
    case = _case(cap, window, seed=int(cap) + head_dim, head_dim=head_dim,
                 block_size=block_size)
    _check(case, cpu_attention.paged_attention(*case.args(), scale=case.scale,
                                               sliding_window=window, logits_soft_cap=cap),
           tol=2e-5)


@pytest.mark.skipif(jax.default_backend() != "cpu" or not cpu_attention.available(),
                    reason="the CPU kernel runs on JAX's CPU backend and needs a C++ compiler")
@pytest.mark.parametrize("logits,caps", [
    # The cap's tanh over its polynomial range, its exp range and saturation, on both signs.
    (np.concatenate([np.linspace(-60, 60, 241), [1e-6, -1e-6, 0.0, 0.3, -0.62]]),
     (0.5, 7.0, 50.0)),
    # Logits far below the cap (x / cap near 0): tanh's error relative to x shows here.
    (np.linspace(-1, 1, 97), (50.0,))])
def test_cpu_kernel_tanh_range(logits, caps):
    # One query against keys whose first coordinate is the logit (q = e_0, scale 1), through
    # the whole kernel: within a few times what float32 costs at best.
    n, d, bs = len(logits), 64, 16
    blocks = -(-n // bs)
    kv = np.zeros((1, 2, 1, blocks, bs, d), np.float32)
    flat_k = np.zeros((blocks * bs, d), np.float32)
    flat_k[:n, 0] = logits
    kv[0, 0, 0] = flat_k.reshape(blocks, bs, d)
    rng = np.random.default_rng(0)
    values = rng.standard_normal((n, d)).astype(np.float32)
    flat_v = np.zeros((blocks * bs, d), np.float32)
    flat_v[:n] = values
    kv[0, 1, 0] = flat_v.reshape(blocks, bs, d)
    q = np.zeros((1, 1, d), np.float32)
    q[0, 0, 0] = 1.0
    args = (q, kv, 0, np.arange(blocks, dtype=np.int32)[None], np.array([n], np.int32),
            np.array([0, 1], np.int32))
    logits32 = np.asarray(logits, np.float32)

    def attend(capped):
        w = np.exp(capped - capped.max())
        return (w / w.sum()) @ values.astype(np.float64)

    for cap in caps:
        expected = attend(cap * np.tanh(logits32.astype(np.float64) / cap))
        # What float32 costs at best: numpy's float32 tanh (within an ulp), the rest exact.
        best = np.float32(cap) * np.tanh(logits32 / np.float32(cap))
        floor = np.abs(attend(best.astype(np.float64)) - expected).max()
        out = np.asarray(cpu_attention.paged_attention(*args, scale=1.0,
                                                       logits_soft_cap=cap))[0, 0]
        assert np.abs(out - expected).max() <= 4 * floor + 1e-7, cap
