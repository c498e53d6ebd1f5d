"""Fixtures of the engine tests: the untied tiny checkpoint, prompts that share prefixes, and
HF's greedy continuations of them."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from tests.utils import MAX_NEW, PROMPT_LENS


@pytest.fixture(scope="module")
def tiny(tiny_models):
    return tiny_models["untied"]


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(42)
    base = [rng.integers(0, 512, n).tolist() for n in PROMPT_LENS]
    # Two prompts sharing a 48-token prefix with the 70-token one (3 full blocks of 16).
    base.append(base[1][:48] + rng.integers(0, 512, 5).tolist())
    base.append(base[1][:50] + rng.integers(0, 512, 12).tolist())
    return base


@pytest.fixture(scope="module")
def hf_greedy(tiny):
    _, hf = tiny

    @functools.cache
    def run(prompt: tuple[int, ...]) -> list[int]:
        import torch

        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW, do_sample=False,
                              min_new_tokens=MAX_NEW, pad_token_id=0)
        return out[0, len(prompt):].tolist()

    return run
