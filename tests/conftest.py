"""Shared fixtures: tiny random Qwen2 checkpoints (HF oracle) and the real embedded model."""

from __future__ import annotations

import numpy as np
import pytest

from pallas_kernels.common import TRITON_DEPRECATION_FILTER
from tests.utils import kv_budget_kwargs, make_tiny_checkpoint


def pytest_configure(config: pytest.Config) -> None:
    # pytest resets warning filters per test: hand it the one the kernels install.
    config.addinivalue_line("filterwarnings", TRITON_DEPRECATION_FILTER)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """{"tied": (path, hf_model), "untied": (path, hf_model)}."""
    out = {}
    for name, tied in (("tied", True), ("untied", False)):
        path = tmp_path_factory.mktemp(f"tiny_{name}")
        out[name] = (path, make_tiny_checkpoint(path, tied, seed=1 if tied else 2))
    return out


@pytest.fixture(scope="session")
def kv_budget() -> dict[str, int]:
    """Engine kwargs of the test KV budget ($JAXLLM_TEST_KV_BLOCKS; {} when unset) for tests
    that build LLM(...) themselves."""
    return kv_budget_kwargs()


@pytest.fixture
def rng():
    return np.random.default_rng(0)


@pytest.fixture(scope="session")
def real_model_path():
    from jaxllm.model_executor.model_loader.default_model import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def real_llm(real_model_path, kv_budget):
    from jaxllm import LLM

    # Small buckets keep start-up (ahead-of-time compilation of every bucket) short. In process
    # on every platform: its tests read the runner's weights. float32: they compare with HF's
    # float32 model. Its KV array stays resident all session beside every other test's memory:
    # 256 blocks (4,096 tokens) hold what its tests run ($JAXLLM_TEST_KV_BLOCKS overrides).
    return LLM(model=str(real_model_path), max_num_seqs=4, max_num_batched_tokens=64,
               show_progress=False, multiprocess_mode=False, dtype="float32",
               **(kv_budget or {"num_kv_blocks": 256}))


@pytest.fixture(scope="session")
def hf_real_model(real_model_path):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        str(real_model_path.parent), gguf_file=real_model_path.name, dtype=torch.float32).eval()
