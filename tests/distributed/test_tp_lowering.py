"""The tensor-parallel step lowers for CUDA on an abstract mesh (no devices) at real model widths
(2 layers), with the Pallas kernels per device and exactly two all-reduces per layer plus the
embedding's."""

from __future__ import annotations

import pytest

from jaxllm.distributed.check_tp_lowering import (
    CASES,
    MODELS,
    collectives,
    lower_sharded_step,
)

TRITON_CALL = "__gpu$xla.gpu.triton"


@pytest.mark.parametrize("name, tp", [(name, tp) for name, sizes in CASES for tp in sizes])
@pytest.mark.parametrize("decode, tokens", [(True, 8), (False, 64)], ids=["decode", "prefill"])
def test_sharded_step_lowers_for_cuda_with_two_all_reduces_per_layer(name, tp, decode, tokens):
    cfg = MODELS[name]
    text = lower_sharded_step(cfg, tp, tokens, decode, max_num_seqs=8)
    assert f"mhlo.num_partitions = {tp} : i32" in text
    assert TRITON_CALL in text  # the Pallas kernels, per device
    c = collectives(text)
    # o_proj and down_proj per layer, one for the vocabulary-parallel embedding.
    assert c.all_reduces == 2 * cfg.num_hidden_layers + 1
    assert c.all_reduce_bytes == c.all_reduces * tokens * cfg.hidden_size * 2  # bf16 [T, hidden]
    # The top-K merge gathers [R, K] candidates and [R] normalisers, never full logits rows.
    rows = min(tokens, 8)
    assert sorted(c.all_gathers) == sorted([(rows, tp * 64), (rows, tp * 64), (tp, rows)])
