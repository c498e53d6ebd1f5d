"""End to end with split-K decode attention active: the engine's decode steps run the split
and combine kernels (Pallas interpret mode on CPU, natively on a GPU), and the greedy tokens
are the reference backend's and Hugging Face's.

`decode_num_splits` gives a decode bucket more than one split only when max_model_len leaves
each split at least 256 keys; a tiny model with 1024 positions and max_model_len 1024 gets 4
splits for every decode bucket, and contexts of 60 to 105 keys span 2 to 4 key tiles of 32
(float32), so 2 to 4 splits hold keys and the combine merges them.
"""

from __future__ import annotations

import numpy as np
import pytest

from pallas_kernels.attention_common import launch_config
from tests.kernel_backends import KERNEL_BACKENDS
from tests.utils import make_llm, make_tiny_checkpoint

MAX_MODEL_LEN = 1024
MAX_NEW = 8
PROMPT_LENS = (97, 60)
# Few buckets (prefill 16, decode 1 and 2): interpret-mode compiles dominate the test.
# float32: compared token for token with float32 HF, and the key tile below is float32's.
ENGINE = dict(max_model_len=MAX_MODEL_LEN, max_num_seqs=2, max_num_batched_tokens=16,
              dtype="float32")


@pytest.fixture(scope="module")
def long_context_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_1024")
    hf = make_tiny_checkpoint(path, tied=True, seed=3, max_position_embeddings=MAX_MODEL_LEN)
    return path, hf


def _greedy(llm, prompts: list[list[int]]) -> list[list[int]]:
    from jaxllm import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_split_k_decode_same_tokens_as_reference_and_hf(long_context_model, backend):
    import torch

    path, hf = long_context_model
    rng = np.random.default_rng(11)
    prompts = [rng.integers(0, 512, n).tolist() for n in PROMPT_LENS]

    llm = make_llm(path, kernel_backend=backend, **ENGINE)
    table = llm.collective_rpc("bucket_table")
    decode = [(tokens, splits) for tokens, max_query_len, splits in table if max_query_len == 1]
    assert decode and all(splits == 4 for _, splits in decode), table
    assert all(splits == 1 for _, max_query_len, splits in table if max_query_len > 1), table
    # The contexts decode runs at span several key tiles, so several splits hold keys.
    block_k = launch_config(2, 1, 16, np.float32)[1]
    assert -(-(min(PROMPT_LENS) + 1) // block_k) >= 2
    assert -(-(max(PROMPT_LENS) + MAX_NEW) // block_k) == 4

    llm.collective_rpc("reset_step_shape_counts")
    got = _greedy(llm, prompts)
    steps = llm.collective_rpc("get_step_shape_counts")
    # Both sequences decode together after their prefills: the 2-token decode bucket ran.
    assert any(max_query_len == 1 and tokens == 2 for tokens, max_query_len, _ in steps), steps

    ref = _greedy(make_llm(path, kernel_backend="reference", **ENGINE), prompts)
    assert got == ref
    for prompt, tokens in zip(prompts, got, strict=True):
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW,
                              min_new_tokens=MAX_NEW, do_sample=False, pad_token_id=0)
        assert tokens == out[0, len(prompt):].tolist()
