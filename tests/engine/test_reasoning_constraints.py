"""A structured-output constraint under a reasoning parser starts after the think block: on
`tiny-qwen2` with `<think>` and `</think>` added to its tokenizer as single tokens (as Qwen3's
has them), a +100 logit_bias on `</think>` makes it the first token while it is still allowed.
Oracle: the regex (the text after `</think>` matches it whole) and the masks of a request that
never reasoned (the manager's draft masks after a drafted `</think>` equal a fresh request's)."""

from __future__ import annotations

import json
import re
import shutil
from types import SimpleNamespace

import numpy as np
import pytest

from jaxllm import LLM, SamplingParams, StructuredOutputsParams
from jaxllm.engine.processor import think_token_ids
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


def test_think_tags_and_where_an_answer_stands(thinking_path, llm):
    tok = load_tokenizer(thinking_path)
    start, end = think_token_ids(tok, "qwen3") or (None, None)
    assert [start] == tok.encode("<think>", add_special_tokens=False)
    assert [end] == tok.encode("</think>", add_special_tokens=False)
    assert think_token_ids(tok, None) is None
    assert think_token_ids(load_tokenizer(tiny_qwen2_path()), "qwen3") is None  # no such tokens
    processor = llm.llm_engine.processor
    nl = tok.encode("\n\n", add_special_tokens=False)
    text = tok.encode("the answer", add_special_tokens=False)
    cases = {  # prompt tail -> (qwen3, deepseek_r1)
        (1, 2): ("answer", "open"),
        (1, start, *nl): ("open", "open"),
        (1, start, 2, end, *nl): ("closed", "closed"),
        (1, start, 2, end, *text): ("answer", "open"),  # an earlier turn's block
        (1, end, start, *nl): ("open", "open"),
    }
    try:
        for prompt, want in cases.items():
            for parser, state in zip(("qwen3", "deepseek_r1"), want, strict=True):
                processor.reasoning_parser = parser
                assert processor.think_state(list(prompt)) == state, (prompt, parser)
    finally:
        processor.reasoning_parser = "qwen3"


def test_the_constraint_starts_after_the_think_block(llm):
    tok = llm.get_tokenizer()
    start, end = tok.convert_tokens_to_ids(["<think>", "</think>"])
    prompt = tok.encode("Answer in lowercase letters:")
    regex = StructuredOutputsParams(regex=REGEX)

    def run(prompt_ids, bias, max_tokens=12):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, logit_bias=bias,
                                structured_outputs=regex)
        return llm.generate({"prompt_token_ids": prompt_ids}, params,
                            use_tqdm=False)[0].outputs[0]

    def answer(ids):
        assert start not in ids and end not in ids, ids
        assert re.fullmatch(REGEX, tok.decode(ids, skip_special_tokens=True)), ids

    # The prompt opens the block: </think> is free until it comes, then the regex.
    out = run(prompt + [start], {end: 100.0})
    assert out.token_ids[0] == end and out.finish_reason == "stop"
    answer(out.token_ids[1:])
    # The prompt closed the block: constrained from the first token, </think> never allowed.
    answer(run(prompt + [start, 198, end, 198], {end: 100.0}).token_ids)
    # No tags (Qwen3 thinking): the first token may open the block (<think> then </think>,
    # each the favourite where it is allowed) ...
    out = run(prompt, {end: 200.0, start: 100.0})
    assert out.token_ids[:2] == [start, end] and out.finish_reason == "stop"
    answer(out.token_ids[2:])
    # ... or be the answer's, constrained at once.
    answer(run(prompt, {end: 100.0, start: -100.0}).token_ids)
    # Without a constraint nothing changes: </think> wins every step.
    free = llm.generate({"prompt_token_ids": prompt},
                        SamplingParams(temperature=0, max_tokens=3, logit_bias={end: 100.0}),
                        use_tqdm=False)[0]
    assert free.outputs[0].token_ids == [end] * 3
    assert_pool_free(llm)


def test_tokens_after_the_block_feed_the_matcher(thinking_path):
    """A step's tokens (verified drafts) that end the block and go on: only those after
    `</think>` reach the matcher, which then completes the grammar."""
    from jaxllm.engine.core import EngineCore

    tok = load_tokenizer(thinking_path)
    start, end = tok.convert_tokens_to_ids(["<think>", "</think>"])
    a, b, x = (tok.encode(c)[0] for c in "abx")
    manager = StructuredOutputManager(thinking_path, VOCAB, max_num_rows=2)
    try:
        def request(end_id, start_id=None):
            so = manager.add_request(StructuredOutputsParams(regex="ab"), [151645])
            assert manager.init_matcher(so)
            so.reasoning_end_token_id, so.reasoning_start_token_id = end_id, start_id
            return so

        def advance(so, tokens):
            core = SimpleNamespace(sampling_states={"r": SimpleNamespace(structured_output=so)})
            return EngineCore._advance_matchers(core, {"r": tokens})  # type: ignore[arg-type]

        so = request(end)
        assert advance(so, [x, x]) == {} and so.is_reasoning  # still thinking
        ends = advance(so, [x, end, a, b])
        assert not so.is_reasoning and so.is_terminated
        assert ends["r"].num_tokens == 4  # the grammar completed by the step's last token
        # The answer's first token decides: <think> opens a block ...
        so = request(end, start)
        assert advance(so, [start, x]) == {} and so.is_reasoning
        # ... anything else is the constrained answer's.
        so = request(end, start)
        ends = advance(so, [a, b])
        assert so.reasoning_end_token_id is None and so.is_terminated
        assert ends["r"].num_tokens == 2
        so = request(end, start)
        assert advance(so, [x])["r"].status.name == "FINISHED_ERROR"  # the regex refuses x
    finally:
        manager.shutdown()


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
        # Before the answer's first token: row 0 is the grammar's and <think>; a drafted
        # <think> opens the block, any other draft is the answer's.
        start = tok.convert_tokens_to_ids("<think>")
        undecided = manager.add_request(spec, eos)
        assert manager.init_matcher(undecided)
        undecided.reasoning_end_token_id, undecided.reasoning_start_token_id = end, start
        with_start = want[0].copy()
        with_start.view(np.uint32)[start >> 5] |= np.uint32(1 << (start & 31))
        plain = manager.draft_bitmasks(undecided, [a, b])
        assert plain is not None
        np.testing.assert_array_equal(plain[0], with_start)
        np.testing.assert_array_equal(plain[1:], want[1:])
        opened = manager.draft_bitmasks(undecided, [start, x, end, a])
        assert opened is not None
        np.testing.assert_array_equal(opened[0], with_start)
        assert (opened[1:3] == -1).all()
        np.testing.assert_array_equal(opened[3:], want[:2])
        unended = manager.draft_bitmasks(undecided, [start, x])
        assert unended is not None and unended.shape[0] == 3 and (unended[1:] == -1).all()
    finally:
        manager.shutdown()
