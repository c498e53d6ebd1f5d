"""A structured-output constraint under a reasoning parser starts after the think block: on
`tiny-qwen2` with `<think>` and `</think>` added to its tokenizer as single tokens (as Qwen3's
has them), a +100 logit_bias on `</think>` makes it the first token while it is still allowed.
Oracle: the regex (the text after `</think>` matches it whole) and the masks of a request that
never reasoned (the manager's draft masks after a drafted `</think>` equal a fresh request's)."""

from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest

from jaxllm import LLM, SamplingParams, StructuredOutputsParams
from jaxllm.engine.processor import think_block_closed, think_token_ids
from jaxllm.model_executor.model_loader.tiny_model import tiny_qwen2_path
from jaxllm.model_executor.model_loader.tokenizer import load_tokenizer
from jaxllm.structured_output.manager import StructuredOutputManager
from tests.utils import assert_pool_free, kv_budget_kwargs

REGEX = "[a-z]{2,6}"
RENAMED = {"<|quad_start|>": "<think>", "<|quad_end|>": "</think>"}
VOCAB = 151936


@pytest.fixture(scope="module")
def thinking_path(tmp_path_factory):
    """tiny-qwen2 whose tokenizer spells <think> and </think> as one token each: two of its
    unused added tokens renamed (its vocabulary is the model's, nothing can be appended)."""
    src = tiny_qwen2_path()
    dst = tmp_path_factory.mktemp("thinking")
    for f in src.iterdir():
        if f.suffix == ".safetensors":
            (dst / f.name).symlink_to(f)
        else:
            shutil.copy(f, dst / f.name)
    spec = json.loads((dst / "tokenizer.json").read_text())
    for old, new in RENAMED.items():
        added = next(a for a in spec["added_tokens"] if a["content"] == old)
        added["content"], added["special"] = new, False
        vocab = spec["model"]["vocab"]
        vocab[new] = vocab.pop(old)
    (dst / "tokenizer.json").write_text(json.dumps(spec))
    config = json.loads((dst / "tokenizer_config.json").read_text())
    for entry in (config.get("added_tokens_decoder") or {}).values():
        if entry.get("content") in RENAMED:
            entry["special"] = False
            entry["content"] = RENAMED[entry["content"]]
    (dst / "tokenizer_config.json").write_text(json.dumps(config))
    return dst


@pytest.fixture(scope="module")
def llm(thinking_path):
    llm = LLM(model=str(thinking_path), reasoning_parser="qwen3", max_model_len=128,
              max_num_seqs=4, max_num_batched_tokens=64, multiprocess_mode=False,
              show_progress=False, **kv_budget_kwargs())
    yield llm
    llm.shutdown()


def test_think_tags_and_closed_blocks(thinking_path):
    tok = load_tokenizer(thinking_path)
    start, end = think_token_ids(tok, "qwen3") or (None, None)
    assert [start] == tok.encode("<think>", add_special_tokens=False)
    assert [end] == tok.encode("</think>", add_special_tokens=False)
    assert think_token_ids(tok, None) is None
    assert think_token_ids(load_tokenizer(tiny_qwen2_path()), "qwen3") is None  # no such tokens
    assert not think_block_closed([1, 2, 3], start, end)
    assert think_block_closed([1, start, 2, end, 3], start, end)
    assert not think_block_closed([1, start, 2, end, start, 4], start, end)


def test_the_constraint_starts_after_the_think_block(llm):
    tok = llm.get_tokenizer()
    start, end = tok.convert_tokens_to_ids(["<think>", "</think>"])
    prompt = tok.encode("Answer in lowercase letters:")
    params = SamplingParams(temperature=0, max_tokens=12, logit_bias={end: 100.0},
                            structured_outputs=StructuredOutputsParams(regex=REGEX))
    open_, closed, opened = llm.generate(
        [{"prompt_token_ids": prompt}, {"prompt_token_ids": prompt + [start, 198, end, 198]},
         {"prompt_token_ids": prompt + [start]}], params, use_tqdm=False)
    for out in (open_, opened):  # the block is the answer's: </think> first, then the regex
        ids = out.outputs[0].token_ids
        assert ids[0] == end and end not in ids[1:], ids
        assert re.fullmatch(REGEX, tok.decode(ids[1:], skip_special_tokens=True)), ids
        assert out.outputs[0].finish_reason == "stop"
    # The prompt closed the block: constrained from the first token, </think> never allowed.
    ids = closed.outputs[0].token_ids
    assert end not in ids
    assert re.fullmatch(REGEX, tok.decode(ids, skip_special_tokens=True)), ids
    # Without a constraint nothing changes: </think> wins every step.
    free = llm.generate({"prompt_token_ids": prompt},
                        SamplingParams(temperature=0, max_tokens=3, logit_bias={end: 100.0}),
                        use_tqdm=False)[0]
    assert free.outputs[0].token_ids == [end] * 3
    assert_pool_free(llm)


def test_draft_masks_start_after_a_drafted_end(thinking_path):
    tok = load_tokenizer(thinking_path)
    end = tok.convert_tokens_to_ids("</think>")
    manager = StructuredOutputManager(thinking_path, VOCAB, max_num_rows=2)
    try:
        spec = StructuredOutputsParams(regex="ab")
        eos = [151645, 151643]
        thinking, fresh = manager.add_request(spec, eos), manager.add_request(spec, eos)
        assert manager.init_matcher(thinking) and manager.init_matcher(fresh)
        thinking.reasoning_end_token_id = end
        a, b = tok.encode("a")[0], tok.encode("b")[0]
        x = tok.encode("x")[0]
        assert manager.draft_bitmasks(thinking, [x, a, b]) is None  # no end: unconstrained
        rows = manager.draft_bitmasks(thinking, [x, end, a, b])
        want = manager.draft_bitmasks(fresh, [a, b])
        assert rows is not None and want is not None
        assert rows.shape[0] == 2 + want.shape[0]
        assert (rows[:2] == -1).all()  # the block: every token allowed
        np.testing.assert_array_equal(rows[2:], want)
        # Rolled back: the matcher still expects its "a".
        again = manager.draft_bitmasks(thinking, [end, a])
        assert again is not None
        np.testing.assert_array_equal(again[1:], want[:2])
    finally:
        manager.shutdown()
