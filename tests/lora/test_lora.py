"""LoRA adapters end to end: requests with different adapters and without one in one batch,
each against Hugging Face transformers running the base weights with that adapter merged in by
numpy (W + scale * B @ A, PEFT's semantics), so the oracle shares no code with jaxllm/lora/."""

from __future__ import annotations

import copy
import json
import shutil
from typing import Any, cast

import numpy as np
import pytest

from jaxllm import LoRARequest, SamplingParams
from tests.lora_adapters import (
    ATTENTION_MODULES,
    FUSED_ATTENTION_MODULES,
    FUSED_MLP_MODULES,
    write_adapter,
)
from tests.utils import (
    compile_count,
    make_llm,
    make_tiny_checkpoint,
    on_each_step,
    random_prompts,
    runner_of,
    scheduler_state,
)

torch = pytest.importorskip("torch", reason="the oracle is Hugging Face transformers (torch)")

MAX_NEW = 8
# Float32 on both sides; the merged weights round differently from the engine's separate
# LoRA matmuls, so logprobs agree to this, not bit for bit.
LOGPROB_ATOL = 2e-4


def merged_model(base, merged: dict):
    """The HF model with the adapter merged into its weights, by numpy."""
    model = copy.deepcopy(base)
    state = model.state_dict()
    for (i, parent, m), (a, b, scale) in merged.items():
        key = f"model.layers.{i}.{parent}.{m}.weight"
        w = state[key].numpy() + scale * (b @ a)
        state[key] = torch.from_numpy(w.astype(np.float32))
    model.load_state_dict(state)
    return model.eval()


def hf_greedy_with_logprobs(model, prompt: list[int]) -> tuple[list[int], list[float]]:
    ids, lps = list(prompt), []
    with torch.no_grad():
        for _ in range(MAX_NEW):
            logp = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].double(), -1)
            ids.append(int(logp.argmax()))
            lps.append(float(logp[ids[-1]]))
    return ids[len(prompt):], lps


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    base_dir = tmp_path_factory.mktemp("base")
    hf = make_tiny_checkpoint(base_dir, tied=False).eval()
    root = tmp_path_factory.mktemp("adapters")
    adapters = {
        # Attention only, rank 8.
        1: write_adapter(root / "a1", hf.config, rank=8, alpha=16, targets=ATTENTION_MODULES,
                         seed=1),
        # The MLP and v only, rank 16, rsLoRA's scaling.
        2: write_adapter(root / "a2", hf.config, rank=16, alpha=8, seed=2, rslora=True,
                         targets=("v_proj", "gate_proj", "up_proj", "down_proj")),
        # Everything, rank 4.
        3: write_adapter(root / "a3", hf.config, rank=4, alpha=8, seed=3,
                         targets=ATTENTION_MODULES + ("gate_proj", "up_proj", "down_proj")),
    }
    requests = {i: LoRARequest(f"adapter{i}", i, str(root / f"a{i}")) for i in adapters}
    oracles = {0: hf, **{i: merged_model(hf, m) for i, m in adapters.items()}}
    # Above the adapters these tests name: each stays read from its first request.
    llm = make_llm(base_dir, enable_lora=True, max_loras=2, max_lora_rank=16, dtype="float32",
                   max_cpu_loras=8)
    return {"base_dir": base_dir, "root": root, "llm": llm, "requests": requests,
            "oracles": oracles, "config": hf.config}


def _params() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)


def _check(setup, prompts: list[list[int]], lora_ids: list[int], outs) -> None:
    _check_against(setup["oracles"], prompts, lora_ids, outs)


def _check_against(oracles: dict, prompts: list[list[int]], lora_ids: list[int], outs) -> None:
    for prompt, lid, out in zip(prompts, lora_ids, outs, strict=True):
        want_tokens, want_lps = hf_greedy_with_logprobs(oracles[lid], prompt)
        comp = out.outputs[0]
        assert comp.token_ids == want_tokens, f"adapter {lid}"
        got = [lp[t].logprob for t, lp in zip(comp.token_ids, comp.logprobs, strict=True)]
        np.testing.assert_allclose(got, want_lps, atol=LOGPROB_ATOL, err_msg=f"adapter {lid}")


def _generate(setup, prompts, lora_ids):
    reqs = [setup["requests"].get(i) for i in lora_ids]
    return setup["llm"].generate([{"prompt_token_ids": p} for p in prompts], _params(),
                                 use_tqdm=False, lora_request=reqs)


def test_two_adapters_and_none_in_one_batch_match_the_merged_models(setup):
    prompts = random_prompts(10, [5, 21, 12, 9])
    ids = [1, 2, 0, 1]
    outs = _generate(setup, prompts, ids)
    _check(setup, prompts, ids, outs)
    # The adapters change the output: the comparison above is not the base model's thrice.
    base = [hf_greedy_with_logprobs(setup["oracles"][0], p)[0] for p in prompts]
    assert outs[0].outputs[0].token_ids != base[0]
    assert outs[1].outputs[0].token_ids != base[1]


def test_one_lora_request_for_every_prompt(setup):
    prompts = random_prompts(11, [6, 14])
    outs = setup["llm"].generate([{"prompt_token_ids": p} for p in prompts], _params(),
                                 use_tqdm=False, lora_request=setup["requests"][2])
    _check(setup, prompts, [2, 2], outs)


def test_prefix_cache_is_not_shared_between_adapters(setup):
    prompt = random_prompts(12, [40])[0]  # two full blocks of 16
    first = _generate(setup, [prompt], [1])[0]
    assert first.num_cached_tokens == 0
    others = _generate(setup, [prompt, prompt], [2, 0])
    assert [o.num_cached_tokens for o in others] == [0, 0]
    _check(setup, [prompt, prompt], [2, 0], others)
    again = _generate(setup, [prompt], [1])[0]
    assert again.num_cached_tokens == 32  # the same adapter does hit its own blocks
    _check(setup, [prompt], [1], [again])


def test_more_adapters_than_slots_all_finish_right_without_recompiling(setup):
    llm = setup["llm"]
    _generate(setup, random_prompts(13, [4]), [3])  # every step shape warm
    before = compile_count(llm)
    prompts = random_prompts(14, [7, 19, 4, 11, 25, 8])
    ids = [3, 1, 2, 0, 3, 2]  # three adapters over two slots
    _check(setup, prompts, ids, _generate(setup, prompts, ids))
    assert compile_count(llm) == before


def test_the_scheduler_runs_at_most_max_loras_adapters_at_once(setup):
    seen: list[set[int]] = []
    running: dict[str, int] = {}

    def record(so):
        for rid in so.finished_req_ids + so.preempted_req_ids:
            running.pop(rid, None)
        for r in so.scheduled:
            running[r.request_id] = r.lora_int_id
        seen.append(set(running.values()) - {0})

    llm = setup["llm"]
    on_each_step(llm, record)
    try:
        _generate(setup, random_prompts(15, [5, 5, 5, 5]), [1, 2, 3, 1])
    finally:
        runner_of(llm).__dict__.pop("prepare", None)
    assert max(len(s) for s in seen) == 2
    assert any(3 in s for s in seen)


def test_bad_lora_requests_are_refused_and_the_engine_keeps_serving(setup, tmp_path):
    llm, root, cfg = setup["llm"], setup["root"], setup["config"]
    write_adapter(tmp_path / "big", cfg, rank=32, alpha=32, targets=("q_proj",), seed=4)
    write_adapter(tmp_path / "dora", cfg, rank=4, alpha=4, targets=("q_proj",), seed=5,
                  use_dora=True)
    write_adapter(tmp_path / "embed", cfg, rank=4, alpha=4, targets=("q_proj",), seed=6)
    emb_cfg = json.loads((tmp_path / "embed" / "adapter_config.json").read_text())
    emb_cfg["target_modules"] = ["q_proj", "embed_tokens"]
    (tmp_path / "embed" / "adapter_config.json").write_text(json.dumps(emb_cfg))
    cases = [
        (LoRARequest("missing", 10, str(tmp_path / "nope")), "does not exist"),
        (LoRARequest("big", 11, str(tmp_path / "big")), "rank 32 exceeds max_lora_rank 16"),
        (LoRARequest("dora", 12, str(tmp_path / "dora")), "DoRA"),
        (LoRARequest("embed", 13, str(tmp_path / "embed")), "embed_tokens"),
        (LoRARequest("clash", 1, str(root / "a2")), "already adapter 'adapter1'"),
        (LoRARequest("zero", 0, str(root / "a2")), r"in \[1, 9223372036854775807\]"),
        (LoRARequest("huge", 2**63, str(root / "a2")), r"in \[1, 9223372036854775807\]"),
        (LoRARequest("path", 14, cast(Any, root / "a2")), "lora_path must be a str"),
        (LoRARequest("listed", 15, str(tmp_path / "listed")), "must hold a JSON object"),
    ]
    write_adapter(tmp_path / "listed", cfg, rank=4, alpha=4, targets=("q_proj",), seed=7)
    (tmp_path / "listed" / "adapter_config.json").write_text("[]")
    _generate(setup, [[1, 2, 3]], [1])  # id 1 known at a1
    for lora, match in cases:
        with pytest.raises(ValueError, match=match):
            llm.generate({"prompt_token_ids": [1, 2, 3]}, _params(), use_tqdm=False,
                         lora_request=lora)
    with pytest.raises(ValueError, match="one per prompt"):
        llm.generate([{"prompt_token_ids": [1, 2]}] * 2, _params(), use_tqdm=False,
                     lora_request=[setup["requests"][1]])
    prompts = random_prompts(16, [6])
    _check(setup, prompts, [2], _generate(setup, prompts, [2]))
    # A path refused as a Path is the same adapter as a str afterwards.
    ok = LoRARequest("path", 14, str(root / "a2"))
    _check(setup, prompts, [2], setup["llm"].generate(
        [{"prompt_token_ids": p} for p in prompts], _params(), use_tqdm=False, lora_request=ok))


def test_an_adapter_is_read_once_its_files_may_go(setup, tmp_path):
    """An adapter's weights are kept from its first request while it is among the
    max_cpu_loras last named: put back into a slot after two others took both, it runs
    although its directory is gone, and the engine stays up."""
    shutil.copytree(setup["root"] / "a1", tmp_path / "copy")
    copy_of_1 = LoRARequest("copy", 21, str(tmp_path / "copy"))
    prompts = random_prompts(17, [7])
    generate = setup["llm"].generate
    outs = generate([{"prompt_token_ids": p} for p in prompts], _params(), use_tqdm=False,
                    lora_request=copy_of_1)
    _check(setup, prompts, [1], outs)
    _generate(setup, prompts * 2, [2, 3])  # both slots taken by others
    shutil.rmtree(tmp_path / "copy")
    outs = generate([{"prompt_token_ids": p} for p in prompts], _params(), use_tqdm=False,
                    lora_request=copy_of_1)
    _check(setup, prompts, [1], outs)
    _check(setup, prompts, [0], _generate(setup, prompts, [0]))


# The other dense families, each with what sets it apart around the projections: Gemma's
# head_dim (not hidden / heads) and tied embeddings, Gemma 2's soft caps and sandwich norms,
# Gemma 3's per-head q/k norms and OLMo 2's whole-projection ones (after qkv_proj: the delta
# must come before them, as PEFT's inside q_proj and k_proj does), Granite's multipliers, and
# Phi-3's fused qkv_proj and gate_up_proj targets with partial rotary (Phi-4-mini's, whose
# q/k head rows the loader reorders, and an adapter's B rows with them).
SPLIT_TARGETS = (ATTENTION_MODULES, ("v_proj", "gate_proj", "up_proj", "down_proj"))
FAMILIES: dict[str, tuple[dict, tuple[tuple[str, ...], tuple[str, ...]]]] = {
    "gemma": (dict(arch="gemma", tied=True), SPLIT_TARGETS),
    "gemma2": (dict(arch="gemma2", tied=True), SPLIT_TARGETS),
    "gemma3": (dict(arch="gemma3", tied=True), SPLIT_TARGETS),
    "granite": (dict(arch="granite", tied=False, embedding_multiplier=6.0,
                     attention_multiplier=0.5, residual_multiplier=0.4, logits_scaling=2.5),
                SPLIT_TARGETS),
    "olmo2": (dict(arch="olmo2", tied=False), SPLIT_TARGETS),
    "phi3": (dict(arch="phi3", tied=False, partial_rotary_factor=0.75),
             (FUSED_ATTENTION_MODULES, ("qkv_proj",) + FUSED_MLP_MODULES)),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_other_dense_families_match_the_merged_models(family, tmp_path):
    """Two adapters of different ranks and targets and a request without one, in one batch."""
    kw, (targets1, targets2) = FAMILIES[family]
    hf = make_tiny_checkpoint(tmp_path / "base", seed=30, **kw).eval()
    adapters = {
        1: write_adapter(tmp_path / "a1", hf.config, rank=8, alpha=16, targets=targets1,
                         seed=31),
        2: write_adapter(tmp_path / "a2", hf.config, rank=4, alpha=8, targets=targets2,
                         seed=32, rslora=True),
    }
    oracles = {0: hf, **{i: merged_model(hf, m) for i, m in adapters.items()}}
    prompts = random_prompts(33, [5, 11, 8])
    ids = [1, 2, 0]
    llm = make_llm(tmp_path / "base", enable_lora=True, max_loras=2, max_lora_rank=8,
                   dtype="float32", max_num_seqs=4, max_num_batched_tokens=32)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _params(),
                            use_tqdm=False,
                            lora_request=[LoRARequest(f"a{i}", i, str(tmp_path / f"a{i}"))
                                          if i else None for i in ids])
    finally:
        llm.shutdown()
    _check_against(oracles, prompts, ids, outs)
    # Each adapter moves its request off the base model's logprobs: the comparison above
    # would notice a delta dropped.
    for prompt, lid, out in zip(prompts, ids, outs, strict=True):
        if lid:
            base_tokens, base_lps = hf_greedy_with_logprobs(hf, prompt)
            comp = out.outputs[0]
            got = [lp[t].logprob for t, lp in zip(comp.token_ids, comp.logprobs, strict=True)]
            assert comp.token_ids != base_tokens \
                or np.abs(np.subtract(got, base_lps)).max() > 100 * LOGPROB_ATOL, lid


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculative_decoding_with_adapters_matches_the_merged_models(setup, method):
    # The draft model is the base model, run without adapters: for a request with one its
    # drafts are often rejected, and what the target accepts must still be the adapter's.
    spec = {"method": method, "num_speculative_tokens": 3}
    if method == "draft_model":
        spec["model"] = str(setup["base_dir"])
    else:
        spec.update(prompt_lookup_min=1, prompt_lookup_max=3)
    llm = make_llm(setup["base_dir"], enable_lora=True, max_loras=2, max_lora_rank=16,
                   dtype="float32", multiprocess_mode=False, speculative_config=spec)
    # Repeated spans give the n-gram proposer drafts.
    prompts = [p * 3 for p in random_prompts(12, [5, 7, 4])] + random_prompts(13, [9])
    ids = [1, 3, 0, 2]
    reqs = [setup["requests"].get(i) for i in ids]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _params(), use_tqdm=False,
                        lora_request=reqs)
    _check(setup, prompts, ids, outs)
    state = scheduler_state(llm)
    assert state["num_spec_accepted_tokens"] > 0
    if method == "draft_model":
        assert state["num_spec_draft_tokens"] > state["num_spec_accepted_tokens"]


def test_moe_model_is_refused_by_name(tmp_path):
    make_tiny_checkpoint(tmp_path, tied=False, arch="qwen2_moe")
    with pytest.raises(ValueError, match="Qwen2MoeForCausalLM: a mixture of experts"):
        make_llm(tmp_path, enable_lora=True)


def test_lora_request_without_enable_lora_is_refused(setup):
    # An engine without LoRA: refuses the request by name and packs no slot field.
    llm = make_llm(setup["base_dir"], dtype="float32", max_num_batched_tokens=16,
                   max_num_seqs=2)
    with pytest.raises(ValueError, match="enable_lora=True"):
        llm.generate({"prompt_token_ids": [1, 2, 3]}, _params(), use_tqdm=False,
                     lora_request=setup["requests"][1])
    runner = runner_of(llm)
    assert runner.lora_slots is None
    assert "lora_slots" not in runner.input_shapes(runner.bucket_shapes()[0])
    llm.shutdown()


def test_interpret_backend_in_a_core_process(setup):
    # The Pallas kernels in interpret mode (Qwen2's q/k/v bias then rides to the RoPE kernel
    # apart from the GEMM) and the core in its own process: the adapters cross the wire.
    llm = make_llm(setup["base_dir"], enable_lora=True, max_loras=2, max_lora_rank=16,
                   dtype="float32", kernel_backend="interpret", multiprocess_mode=True,
                   max_num_seqs=4, max_num_batched_tokens=32)
    try:
        prompts = random_prompts(17, [6, 11, 4])
        ids = [2, 0, 1]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _params(),
                            use_tqdm=False, lora_request=[setup["requests"].get(i) for i in ids])
        _check(setup, prompts, ids, outs)
    finally:
        llm.shutdown()


