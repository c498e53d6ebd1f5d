"""LoRA's parts that need no model: the engine settings refused, the request on the wire to a
core process, the prefix cache's adapter key and the server's `--lora-modules` names (the
engine tests, against Hugging Face, are test_lora.py's)."""

from __future__ import annotations

import pytest

from jaxllm import LoRARequest, SamplingParams
from jaxllm.engine import EngineCoreRequest
from jaxllm.engine.arg_utils import EngineArgs
from jaxllm.engine.serial_utils import MsgpackDecoder, MsgpackEncoder
from scheduler.block_pool import hash_block_tokens


def _params() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=0)


def test_engine_settings_lora_refuses():
    with pytest.raises(ValueError, match="tensor_parallel_size > 1"):
        EngineArgs(enable_lora=True, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="speculative_config"):
        EngineArgs(enable_lora=True, speculative_config={"method": "ngram",
                                                         "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="max_lora_rank must be a positive integer"):
        EngineArgs(enable_lora=True, max_lora_rank=0)


def test_lora_request_travels_to_a_core_process():
    req = EngineCoreRequest(request_id="r", prompt_token_ids=[1, 2], sampling_params=_params(),
                            eos_token_ids=[0], max_tokens=4,
                            lora_request=LoRARequest("a", 7, "/x"))
    back = MsgpackDecoder(EngineCoreRequest).decode(MsgpackEncoder().encode(req))
    assert back.lora_request == LoRARequest("a", 7, "/x")


def test_block_hash_keys_on_the_adapter():
    tokens = list(range(16))
    assert hash_block_tokens(None, tokens, 0) == hash_block_tokens(None, tokens)
    assert len({hash_block_tokens(None, tokens, i) for i in (0, 1, 2)}) == 3


def test_server_lora_modules_name_models():
    from types import SimpleNamespace

    from jaxllm.entrypoints.cli.serve import parse_lora_modules
    from jaxllm.entrypoints.openai.protocol import APIError
    from jaxllm.entrypoints.openai.serving_engine import OpenAIServing

    mods = parse_lora_modules(["sql=/adapters/sql", "chat=/adapters/chat"])
    assert [(m.lora_name, m.lora_int_id) for m in mods.values()] == [("sql", 1), ("chat", 2)]
    for bad in (["nopath"], ["a=/x", "a=/y"]):
        with pytest.raises(ValueError, match="--lora-modules"):
            parse_lora_modules(bad)
    serving = SimpleNamespace(model_name="base", lora_modules=mods)
    assert OpenAIServing.check_model(serving, None) is None
    assert OpenAIServing.check_model(serving, "base") is None
    assert OpenAIServing.check_model(serving, "chat") == mods["chat"]
    assert OpenAIServing.response_model(serving, "chat") == "chat"
    assert OpenAIServing.response_model(serving, None) == "base"
    with pytest.raises(APIError, match="`base`, `sql`, `chat`"):
        OpenAIServing.check_model(serving, "other")
