"""Structured outputs end to end on `tiny-qwen2` (random weights, the real Qwen2.5 tokenizer and
vocabulary), in both engine modes: in process with async scheduling and top-K candidate
sampling, and the core in its own process, synchronous, full-row sampling, with a KV cache small
enough to preempt and a token budget small enough to chunk prefills.

Oracles: `json` + `jsonschema` for JSON, `re.fullmatch` for regexes, the choice list, `json`
for the Lark grammar's nested lists (checked shape by shape here) and a hand-written recogniser
for the GBNF grammar; the model's own prompt logprobs for the raw logprobs; each unconstrained
request's output alone for mixed batches. Random weights wander in JSON whitespace, so JSON
specs disable it and schemas are bounded.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.engine.processor import Processor
from jaxllm.model_executor.model_loader.tiny_model import tiny_qwen2_path
from jaxllm.sample import host_sampler
from scheduler import RequestStatus
from tests.utils import assert_pool_free, core_of, kv_budget_kwargs, scheduler_state

PERSON = {"type": "object", "additionalProperties": False,
          "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                                  "maxItems": 2}}}
REGEX = r"[a-z]{2,6}-[0-9]{1,3}"
CHOICES = ["alpha", "beta", "gamma delta"]
# Nested digit lists: one to three items, each a digit or a list of one or two digits.
LARK = """start: "[" item ("," item)~0..2 "]"
item: DIGIT | inner
inner: "[" DIGIT ("," DIGIT)~0..1 "]"
DIGIT: /[0-9]/"""
# One to two words of one to three letters, "|"-separated, in angle brackets.
GBNF = """root ::= "<" word ("|" word)? ">"
word ::= [a-z] [a-z]? [a-z]?"""
PROMPTS = ["Give me a record:", "Now answer with one line of output, please, as asked before:",
           "x"]
SEED = 1234


def in_lark_language(text: str) -> bool:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return False
    if text != json.dumps(value, separators=(",", ":")) or not isinstance(value, list):
        return False

    def digit(v) -> bool:
        return isinstance(v, int) and 0 <= v <= 9

    return 1 <= len(value) <= 3 and all(
        digit(v) or (isinstance(v, list) and 1 <= len(v) <= 2 and all(map(digit, v)))
        for v in value)


def in_gbnf_language(text: str) -> bool:
    if len(text) < 3 or text[0] != "<" or text[-1] != ">":
        return False
    words = text[1:-1].split("|")
    return 1 <= len(words) <= 2 and all(
        1 <= len(w) <= 3 and all("a" <= c <= "z" for c in w) for w in words)


def json_object_check(text: str) -> bool:
    value = json.loads(text)
    return isinstance(value, dict)


# kind -> (spec, checker, extra SamplingParams)
KINDS = {
    "json": (dict(json=PERSON, disable_any_whitespace=True),
             lambda t: jsonschema.validate(json.loads(t), PERSON) is None, {}),
    "regex": (dict(regex=REGEX), lambda t: re.fullmatch(REGEX, t) is not None, {}),
    "choice": (dict(choice=CHOICES), lambda t: t in CHOICES, {}),
    "lark": (dict(grammar=LARK), in_lark_language, {}),
    "gbnf": (dict(grammar=GBNF), in_gbnf_language, {}),
}


def make_llm(**kw) -> LLM:
    args = dict(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64,
                show_progress=False, num_kv_blocks=512)
    args.update(kv_budget_kwargs())
    args.update(kw)
    return LLM(model=str(tiny_qwen2_path()), **args)


@pytest.fixture(scope="module")
def inproc():
    """In process, async scheduling, top-K candidate sampling."""
    return make_llm(multiprocess_mode=False, async_scheduling=True, topk_sampling=True)


@pytest.fixture(scope="module")
def mp():
    """The core in its own process, synchronous, full rows; 8 usable KV blocks of 16 tokens
    for up to 8 requests (preemption) and a 32-token step budget (chunked prefill)."""
    return make_llm(multiprocess_mode=True, async_scheduling=False, topk_sampling=False,
                    num_kv_blocks=9, max_num_batched_tokens=32)


@pytest.fixture(params=["inproc", "mp"])
def llm(request):
    return request.getfixturevalue(request.param)


def kind_params(spec: dict, extra: dict, seeded: bool, **kw) -> SamplingParams:
    sampling = dict(temperature=1.0, seed=SEED) if seeded else dict(temperature=0.0)
    return SamplingParams(max_tokens=40, structured_outputs=spec, **sampling, **extra, **kw)


def run_every_kind(llm: LLM) -> dict[tuple[str, bool, int], tuple[str, str, list[int]]]:
    """Every kind, greedy and seeded, on every prompt, in one batch: (kind, seeded, prompt)
    -> (text, finish_reason, token ids)."""
    keys, prompts, params = [], [], []
    for kind, (spec, _, extra) in KINDS.items():
        for seeded in (False, True):
            for i, prompt in enumerate(PROMPTS):
                keys.append((kind, seeded, i))
                prompts.append(prompt)
                params.append(kind_params(spec, extra, seeded))
    outs = llm.generate(prompts, params, use_tqdm=False)
    return {k: (o.outputs[0].text, o.outputs[0].finish_reason, o.outputs[0].token_ids)
            for k, o in zip(keys, outs, strict=True)}


@pytest.fixture(scope="module")
def results(inproc, mp):
    """Both engines' outputs of the batch of every kind (top-K rows counted in process)."""
    fast = []
    original = host_sampler.sample_from_topk

    def counting(topk, metadata, u, masked=None):
        if masked is not None:
            fast.append(len(metadata))
        return original(topk, metadata, u, masked)

    core = core_of(inproc)
    first_use = scheduler_state(inproc)["num_grammars_compiled"] == 0
    steps = []
    step = core.step

    def counting_steps():
        steps.append(1)
        return step()

    host_sampler.sample_from_topk = counting
    core.step = counting_steps
    try:
        got = {"inproc": run_every_kind(inproc)}
    finally:
        host_sampler.sample_from_topk = original
        del core.step
    assert sum(fast) > 0, "no constrained row was sampled from its top-K candidates"
    if first_use:
        # The first constrained requests wait about a second for the tokenizer: the core
        # blocks on it instead of returning thousands of empty steps.
        assert len(steps) < 400, len(steps)
    preemptions = scheduler_state(mp)["num_preemptions"]
    got["mp"] = run_every_kind(mp)
    assert scheduler_state(mp)["num_preemptions"] > preemptions, "the small KV cache preempted " \
                                                                 "nothing"
    return got


@pytest.mark.parametrize("mode", ["inproc", "mp"])
def test_every_kind_is_enforced(results, mode, request):
    for (kind, seeded, i), (text, finish, _) in results[mode].items():
        where = f"{mode}: {kind}, {'seeded' if seeded else 'greedy'}, prompt {i}: {text!r}"
        assert finish == "stop", where
        assert KINDS[kind][1](text), where
    assert_pool_free(request.getfixturevalue(mode))


def test_modes_agree_and_seeds_repeat(results, mp):
    # Greedy rows: top-K candidates against full rows, async against synchronous, preempted and
    # chunked against not, the same tokens. Seeded rows draw by inverse CDF over the masked
    # row, and a token's logits move at float32 rounding with the step's batch (XLA's CPU
    # matmuls sum in another order for another row count), so a draw that falls within that
    # of a boundary picks the neighbouring token: the sampler tests compare the two sampling
    # paths on identical logits instead (tests/sample/test_grammar_mask.py).
    greedy = [k for k in results["inproc"] if not k[1]]
    assert len(greedy) == len(KINDS) * len(PROMPTS)
    assert {k: results["inproc"][k] for k in greedy} == {k: results["mp"][k] for k in greedy}
    # Seeds are per request: the same seeded request twice in one batch draws the same tokens
    # (a generator shared by the batch would give them different draws), and so does the same
    # batch again (the same logits, for the reason above).
    sp = kind_params(KINDS["regex"][0], {}, True)
    texts = [o.outputs[0].text for _ in range(2)
             for o in mp.generate(PROMPTS[:1] * 2, [sp, sp], use_tqdm=False)]
    assert len(set(texts)) == 1 and re.fullmatch(REGEX, texts[0]), texts


def test_json_object_mask_comes_before_logit_bias(inproc):
    tok = inproc.get_tokenizer()
    close, x = tok.encode("}")[0], tok.encode("x")[0]
    # "x" is never allowed right after "{": however large its bias, the object closes.
    sp = SamplingParams(temperature=0.0, max_tokens=20, logit_bias={close: 50.0, x: 100.0},
                        structured_outputs=dict(json_object=True, disable_any_whitespace=True))
    out = inproc.generate(PROMPTS[0], sp, use_tqdm=False)[0].outputs[0]
    assert json_object_check(out.text) and json.loads(out.text) == {}
    assert out.finish_reason == "stop"
    plain = inproc.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=3,
                                                       logit_bias={x: 100.0}),
                            use_tqdm=False)[0].outputs[0]
    assert plain.text == "xxx"  # unconstrained, the bias wins


def test_n_children_and_the_grammar_cache(llm):
    schema = {**PERSON, "properties": {**PERSON["properties"],
                                       "name": {"type": "string", "maxLength": 4}}}
    spec = dict(json=schema, disable_any_whitespace=True)
    compiled = scheduler_state(llm)["num_grammars_compiled"]
    sp = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=40, structured_outputs=spec)
    outs = llm.generate([PROMPTS[0], PROMPTS[2]], [sp, kind_params(spec, {}, False)],
                        use_tqdm=False)
    texts = [c.text for o in outs for c in o.outputs]
    assert len(texts) == 4
    for o in outs:
        for c in o.outputs:
            jsonschema.validate(json.loads(c.text), schema)
            assert c.finish_reason == "stop"
    # Four requests (three children and one other), one spec: compiled once.
    assert scheduler_state(llm)["num_grammars_compiled"] == compiled + 1
    assert_pool_free(llm)


def test_mixed_batches_leave_unconstrained_requests_unchanged(llm):
    free = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
            SamplingParams(temperature=0.8, seed=3, max_tokens=12, ignore_eos=True,
                           logprobs=2)]
    alone = llm.generate(PROMPTS[:2], free, use_tqdm=False)
    spec = KINDS["json"][0]
    mixed = llm.generate([PROMPTS[2], PROMPTS[0], PROMPTS[1], PROMPTS[2]],
                         [kind_params(spec, {}, False), free[0], free[1],
                          kind_params(KINDS["lark"][0], {}, True)], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[1:3]] == \
        [o.outputs[0].token_ids for o in alone]
    assert KINDS["json"][1](mixed[0].outputs[0].text)
    assert in_lark_language(mixed[3].outputs[0].text)
    assert_pool_free(llm)


def test_logprobs_are_the_raw_distribution(llm):
    sp = kind_params(KINDS["json"][0], {}, False, logprobs=1)
    prompt_ids = llm.get_tokenizer().encode(PROMPTS[1])
    out = llm.generate({"prompt_token_ids": prompt_ids}, sp, use_tqdm=False)[0].outputs[0]
    tokens = out.token_ids
    got = [lp[t].logprob for lp, t in zip(out.logprobs, tokens, strict=True)]
    # The oracle: the unconstrained model's logprob of each token after the same prefix.
    forced = llm.generate({"prompt_token_ids": prompt_ids + tokens},
                          SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    want = [forced.prompt_logprobs[len(prompt_ids) + j][t].logprob
            for j, t in enumerate(tokens)]
    assert got == pytest.approx(want, abs=2e-3)
    # Renormalised over the allowed tokens they would be near 0 where the grammar forces a
    # token the random model does not favour.
    assert min(got) < -5.0
    assert out.cumulative_logprob == pytest.approx(sum(got), abs=1e-3)


def test_a_complete_grammar_stops_even_with_ignore_eos_and_min_tokens(llm):
    outs = llm.generate(
        PROMPTS,
        [kind_params(KINDS["choice"][0], {}, False, ignore_eos=True, min_tokens=5),
         kind_params(KINDS["regex"][0], {}, True, ignore_eos=True),
         kind_params(KINDS["gbnf"][0], {}, False, ignore_eos=True)], use_tqdm=False)
    for o, check in zip(outs, [KINDS["choice"][1], KINDS["regex"][1], in_gbnf_language],
                        strict=True):
        c = o.outputs[0]
        assert c.finish_reason == "stop" and c.stop_reason is None
        assert check(c.text), c.text
        assert len(c.token_ids) < 40
    assert_pool_free(llm)


def test_a_grammar_that_fails_to_compile_finishes_with_error(llm):
    # Valid without a tokenizer; the core's compilation finds no such special token.
    bad = SamplingParams(max_tokens=5, structured_outputs=dict(grammar='start: "a" <|nope|>'))
    good = kind_params(KINDS["choice"][0], {}, False)
    outs = llm.generate(PROMPTS[:2], [bad, good], use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "error"
    assert outs[0].outputs[0].token_ids == []
    assert "<|nope|>" in outs[0].outputs[0].stop_reason
    assert outs[1].outputs[0].text in CHOICES
    assert_pool_free(llm)


@pytest.mark.parametrize("spec", [dict(json={"type": "nonsense"}), dict(regex="a("),
                                  dict(grammar="start: ("), dict(grammar='root ::= "a'),
                                  dict(choice=[])])
def test_invalid_specs_are_refused_before_anything_is_queued(inproc, spec):
    kind = next(iter(spec))
    with pytest.raises(ValueError, match=f"structured_outputs.{kind}"):
        inproc.generate(PROMPTS[0], SamplingParams(max_tokens=2, structured_outputs=spec),
                        use_tqdm=False)
    assert_pool_free(inproc)


def test_a_constrained_request_needs_a_tokenizer(inproc):
    info = inproc.llm_engine.engine_core_client.get_engine_info()
    processor = Processor(None, info, frozenset(info.eos_token_ids), 4)
    with pytest.raises(ValueError, match="structured_outputs needs a tokenizer"):
        processor.process_inputs("r", {"prompt_token_ids": [1, 2]},
                                 kind_params(KINDS["regex"][0], {}, False))


def test_abort_while_waiting_for_the_grammar(inproc):
    engine = inproc.llm_engine
    spec = dict(regex="[a-z]{3}-waiting")
    engine.add_request("waits", PROMPTS[0], kind_params(spec, {}, False))
    state = scheduler_state(inproc)
    assert state["num_waiting_for_grammar"] == state["num_requests"] == 1
    assert state["num_waiting_reqs"] == 1 and engine.has_unfinished_requests()
    engine.abort_request("waits")
    assert not engine.has_unfinished_requests()
    assert_pool_free(inproc)
    # Served after an abort: the same spec again, to the end.
    done = inproc.generate(PROMPTS[0], kind_params(spec, {}, False), use_tqdm=False)
    assert re.fullmatch("[a-z]{3}-waiting", done[0].outputs[0].text)
    assert_pool_free(inproc)


def test_a_dead_end_finishes_with_error_and_the_engine_goes_on(inproc):
    engine, core = inproc.llm_engine, core_of(inproc)
    tok = inproc.get_tokenizer()
    engine.add_request("dead", PROMPTS[0],
                       kind_params(dict(regex="[a-z]{5,9}"), {}, False, ignore_eos=True))
    engine.add_request("alive", PROMPTS[1], kind_params(KINDS["regex"][0], {}, False))
    done = {}
    broken = False
    for _ in range(200):
        if not engine.has_unfinished_requests():
            break
        state = core.sampling_states.get("dead")
        if not broken and state is not None and state.structured_output.matcher is not None:
            # A token the grammar refuses puts the matcher in its error state for good.
            assert not state.structured_output.matcher.consume_token(tok.encode("!")[0])
            broken = True
        for o in engine.step():
            done[o.request_id] = o.outputs[0]
    assert broken and set(done) == {"dead", "alive"}
    assert done["dead"].finish_reason == "error"
    assert "matcher" in done["dead"].stop_reason
    assert re.fullmatch(REGEX, done["alive"].text) and done["alive"].finish_reason == "stop"
    assert RequestStatus.FINISHED_ERROR.finish_reason == "error"
    assert_pool_free(inproc)
    again = inproc.generate(PROMPTS[0], kind_params(KINDS["choice"][0], {}, False),
                            use_tqdm=False)
    assert again[0].outputs[0].text in CHOICES
    assert_pool_free(inproc)
