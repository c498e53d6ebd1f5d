"""The engine stages: tiny (a small random checkpoint against Hugging Face: float32 tokens equal,
no compile after warm-up, the KV array updated in place by every step bucket, the pool free
again; bf16 close; split-K; preemption, chunked prefill and prefix hits; the invariants again
with the engine core in its own process) and parity (the embedded model against Hugging Face).

Everything read from the engine comes through its utility calls, so one check runs against
either engine mode."""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.gpu.harness import (
    StageRun,
    greedy_ids,
    hf_greedy,
    kv_pool_check,
    platform_check,
    top_k_close,
)

# float32 engines compare with a float32 oracle: no TF32 on a GPU.
F32 = dict(dtype="float32", matmul_precision="highest")


def tiny_prompts(vocab: int) -> list[list[int]]:
    import numpy as np

    from tests.utils import PROMPT_LENS

    rng = np.random.default_rng(42)
    base = [rng.integers(0, vocab, n).tolist() for n in PROMPT_LENS]
    # Two prompts sharing 48 tokens (3 full blocks) with the 70-token one: prefix cache hits.
    base.append(base[1][:48] + rng.integers(0, vocab, 5).tolist())
    base.append(base[1][:50] + rng.integers(0, vocab, 12).tolist())
    return base


def token_ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def recompiles_when_warm(llm, prompts: list[list[int]], max_tokens: int,
                         want: list[list[int]]) -> dict[str, Any]:
    """The same requests once more: they must compile nothing in the process that holds the
    model runner, and give the same tokens."""
    before = llm.collective_rpc("get_compile_count")
    again = token_ids(greedy_ids(llm, prompts, max_tokens))
    after = llm.collective_rpc("get_compile_count")
    return {"ok": after == before and again == want, "compiles_after_warmup": after - before,
            "same_tokens_again": again == want}


def bucket_kv_analysis(llm) -> dict[str, Any]:
    """Per compiled step bucket: whether its HLO copies a KV-shaped array (the donated KV array
    must be updated in place) and its memory analysis (alias bytes must cover the KV array)."""
    kv = llm.collective_rpc("get_kv_cache_info")
    dims = ",".join(str(d) for d in kv["shape"])
    copy_re = re.compile(r"=\s*\S+\[" + re.escape(dims) + r"\][^=]*\bcopy(-start)?\(")
    rows, ok = [], True
    for num_tokens, max_query_len, _ in llm.collective_rpc("bucket_table"):
        shape = [num_tokens, max_query_len]
        ma = llm.collective_rpc("get_memory_analysis", shape)
        copies = len(copy_re.findall(llm.collective_rpc("get_compiled_hlo", shape)))
        good = copies == 0 and ma["alias"] >= kv["nbytes"]
        ok &= good
        rows.append({"bucket": shape, "kv_copies": copies, "alias_bytes": ma["alias"],
                     "temp_bytes": ma["temp"], "ok": good})
    return {"ok": ok and bool(rows), "kv_bytes": kv["nbytes"], "kv_shape": kv["shape"],
            "buckets": rows}


def engine_invariants(run: StageRun, prefix: str, llm, prompts: list[list[int]],
                      max_tokens: int, want: list[list[int]]) -> None:
    """The checks every engine mode must pass, named `prefix` + check."""
    backend = llm.llm_engine.engine_config.kernel_backend
    run.check(prefix + "zero_compiles_after_warmup",
              lambda: recompiles_when_warm(llm, prompts, max_tokens, want))
    run.check(prefix + "kv_in_place_every_bucket",
              lambda: {**bucket_kv_analysis(llm), "backend": backend})
    run.check(prefix + "kv_pool_free", lambda: kv_pool_check(llm))


def stage_tiny(run: StageRun) -> None:
    sizes = run.sizes
    if run.check("platform", lambda: platform_check(sizes)) is None:
        return
    from jaxllm import LLM
    from tests.utils import make_tiny_checkpoint, scheduler_state

    work = Path(tempfile.mkdtemp(prefix="gpu_checks_tiny_"))
    prompts = tiny_prompts(sizes.tiny_vocab)
    new = sizes.tiny_new_tokens
    state: dict[str, Any] = {}
    base = dict(skip_tokenizer_init=True, max_model_len=sizes.tiny_max_model_len,
                max_num_seqs=8, max_num_batched_tokens=64, show_progress=False,
                multiprocess_mode=False, num_kv_blocks=64)

    def engine(**kw):
        return LLM(model=str(work / "ckpt"), **{**base, **kw})

    def make_model() -> dict[str, Any]:
        # Positions up to the split-K check's max_model_len.
        hf = make_tiny_checkpoint(work / "ckpt", tied=False, vocab_size=sizes.tiny_vocab,
                                  max_position_embeddings=max(512, sizes.split_k_max_model_len))
        state["hf"] = hf
        state["hf_tokens"] = hf_greedy(hf, prompts, new)
        return {"ok": True, "vocab_size": sizes.tiny_vocab, "path": str(work / "ckpt"),
                "hf_device": str(next(hf.parameters()).device)}

    if run.check("make_checkpoint", make_model) is None:
        return

    def f32_greedy() -> dict[str, Any]:
        want = state["hf_tokens"]
        ref = engine(kernel_backend="reference", **F32)
        pal = ref  # the dry run's engines are the reference backend's: one engine serves
        try:
            state["ref_f32"] = greedy_ids(ref, prompts, new, logprobs=5)
            got_ref = token_ids(state["ref_f32"])
            if sizes.engine_backend != "reference":
                ref.shutdown()
                pal = engine(kernel_backend=sizes.engine_backend, **F32)
            got_pal = token_ids(greedy_ids(pal, prompts, new))
        except BaseException:
            pal.shutdown()  # idempotent: ref may be pal, or shut down already
            ref.shutdown()
            raise
        # Kept for the invariants below only once it has produced its tokens.
        state["engine"], state["pal_tokens"] = pal, got_pal
        mism = [i for i, (a, b, c) in enumerate(zip(got_pal, got_ref, want, strict=True))
                if not a == b == c]
        return {"ok": not mism, "backend": sizes.engine_backend, "prompts": len(prompts),
                "tokens_per_prompt": new, "mismatched_prompts": mism}

    run.check("f32_pallas_eq_reference_eq_hf", f32_greedy)
    if "engine" in state:
        pal = state.pop("engine")
        try:
            engine_invariants(run, "", pal, prompts, new, state["pal_tokens"])
        finally:
            pal.shutdown()

    def bf16_close() -> dict[str, Any]:
        pal = engine(dtype="bfloat16", kernel_backend=sizes.engine_backend)
        try:
            b = greedy_ids(pal, prompts, new, logprobs=5)
            pool = kv_pool_check(pal)
        finally:
            pal.shutdown()
        res = top_k_close(state["ref_f32"], b)
        return {**res, "ok": res["ok"] and pool["ok"], "pool": pool}

    run.check("bf16_logprob_close", bf16_close)

    def split_k() -> dict[str, Any]:
        import numpy as np

        rng = np.random.default_rng(7)
        long = [rng.integers(0, sizes.tiny_vocab, n).tolist() for n in (300, 5)]
        kw = dict(max_model_len=sizes.split_k_max_model_len, max_num_seqs=2,
                  num_kv_blocks=2 * sizes.split_k_max_model_len // 16 + 2, **F32)
        # Split-K exists only in the Pallas kernels (interpret mode in a dry run).
        pal = engine(kernel_backend=sizes.kernel_backend, **kw)
        try:
            table = pal.collective_rpc("bucket_table")
            got = token_ids(greedy_ids(pal, long, new))
            pool = kv_pool_check(pal)
        finally:
            pal.shutdown()
        want = hf_greedy(state["hf"], long, new)
        splits = sorted({s for _, q, s in table if q == 1})
        return {"ok": got == want and max(splits) > 1 and pool["ok"],
                "decode_splits": splits, "bucket_table": table, "same_as_hf": got == want}

    run.check("split_k_end_to_end", split_k)

    def pressure() -> dict[str, Any]:
        # 14 blocks of 16 tokens cannot hold the first 6 prompts with their new tokens at once
        # (preemption); a 16-token budget splits every longer prompt (chunked prefill); the
        # prefix-sharing prompts come after their source (prefix cache hits). The engine core
        # runs in its own process, where the invariants are checked again below.
        want = state["hf_tokens"]
        llm = engine(kernel_backend=sizes.engine_backend, num_kv_blocks=14,
                     max_num_batched_tokens=16, multiprocess_mode=True, **F32)
        try:
            first = greedy_ids(llm, prompts[:6], new)
            second = greedy_ids(llm, prompts[6:], new)
            pool = kv_pool_check(llm)
            sched = scheduler_state(llm)
        except BaseException:
            llm.shutdown()
            raise
        state["mp_engine"] = llm
        got = token_ids(first + second)
        need = sum(-(-(len(p) + new) // 16) for p in prompts[:6])
        cached = [o.num_cached_tokens for o in second]
        ok = got == want and pool["ok"] and min(cached) > 0 and sched["num_preemptions"] > 0
        return {"ok": ok, "same_as_hf": got == want, "multiprocess": True, "kv_blocks": 14,
                "blocks_to_hold_all": need, "longest_prompt": max(map(len, prompts)),
                "token_budget": 16, "preemptions": sched["num_preemptions"],
                "cached_tokens_of_prefix_prompts": cached, "pool": pool}

    run.check("preemption_chunked_prefill_prefix_hits", pressure)
    if "mp_engine" in state:
        llm = state.pop("mp_engine")
        try:
            engine_invariants(run, "multiprocess_", llm, prompts, new, state["hf_tokens"])
        finally:
            llm.shutdown()


# --------------------------------------------------------------------------- parity


def load_hf(path: Path):
    import torch
    from transformers import AutoModelForCausalLM

    if path.is_dir():
        hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    else:
        hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                  dtype=torch.float32)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    return hf.to("cuda" if torch.cuda.is_available() else "cpu").eval()


PARITY_TEXTS = ("def fibonacci(n):", "The capital of France is", "import numpy as np\n",
                "SELECT name FROM users WHERE", "Once upon a time, there was",
                "# Sort a list in Python\n")


def stage_parity(run: StageRun) -> None:
    sizes = run.sizes
    if run.check("platform", lambda: platform_check(sizes)) is None:
        return
    import numpy as np

    from jaxllm import LLM, SamplingParams
    from jaxllm.config import resolve_model

    path = resolve_model(sizes.parity_model)
    state: dict[str, Any] = {}
    new = sizes.parity_new_tokens
    base = dict(model=None if sizes.parity_model is None else str(path), max_model_len=512,
                max_num_seqs=sizes.parity_prompts, max_num_batched_tokens=sizes.bench_tokens,
                show_progress=False,
                multiprocess_mode=False, kernel_backend=sizes.engine_backend,
                quantization="none", num_kv_blocks=128)

    def setup() -> dict[str, Any]:
        state["hf"] = load_hf(path)
        from transformers import AutoTokenizer

        tok_dir = os.environ.get("JAXLLM_GPU_TOKENIZER")
        if tok_dir:
            tok = AutoTokenizer.from_pretrained(tok_dir, local_files_only=True)
        else:
            from jaxllm.model_executor.model_loader.tokenizer import load_tokenizer

            tok = load_tokenizer(path)
        state["prompts"] = [tok(t).input_ids for t in PARITY_TEXTS[:sizes.parity_prompts]]
        return {"ok": True, "model": str(path), "tokenizer": tok_dir or "from the model",
                "hf_device": str(next(state["hf"].parameters()).device)}

    run.check("load_hf_and_tokenize", setup)

    def hf_logprobs(prompt: list[int]) -> np.ndarray:
        import torch

        hf = state["hf"]
        with torch.no_grad():
            logits = hf(torch.tensor([prompt], device=next(hf.parameters()).device)).logits[0]
        return torch.log_softmax(logits.float(), -1).cpu().numpy()

    def f32() -> dict[str, Any]:
        prompts = state["prompts"]
        llm = LLM(skip_tokenizer_init=True, **base, **F32)
        sp = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
        try:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
            greedy = greedy_ids(llm, prompts, new, logprobs=5)
            pool = kv_pool_check(llm)
        finally:
            llm.shutdown()
        want = hf_greedy(state["hf"], prompts, new)
        worst = 0.0
        for p, o in zip(prompts, outs, strict=True):
            ref = hf_logprobs(p)
            # prompt_logprobs[i] scores token i given tokens < i (None for the first).
            for i in range(1, len(p)):
                worst = max(worst, float(abs(o.prompt_logprobs[i][p[i]].logprob
                                             - ref[i - 1, p[i]])))
        state["f32"] = greedy
        same = [g.outputs[0].token_ids == w for g, w in zip(greedy, want, strict=True)]
        return {"ok": worst < 2e-3 and all(same) and pool["ok"], "backend": sizes.engine_backend,
                "max_abs_logprob_diff": worst, "tolerance": 2e-3, "greedy_same_as_hf": same,
                "pool": pool}

    run.check("f32_logits_and_greedy_vs_hf", f32)

    def bf16() -> dict[str, Any]:
        llm = LLM(dtype="bfloat16", skip_tokenizer_init=True, **base)
        try:
            got = greedy_ids(llm, state["prompts"], new, logprobs=5)
            pool = kv_pool_check(llm)
        finally:
            llm.shutdown()
        res = top_k_close(state["f32"], got)
        return {**res, "ok": res["ok"] and pool["ok"], "pool": pool}

    run.check("bf16_logprob_close", bf16)

    def pressure() -> dict[str, Any]:
        prompts = state["prompts"] * 2
        llm = LLM(skip_tokenizer_init=True, **F32,
                  **{**base, "num_kv_blocks": 8, "max_num_batched_tokens": 16})
        try:
            got = token_ids(greedy_ids(llm, prompts, new))
            pool = kv_pool_check(llm)
        finally:
            llm.shutdown()
        want = [o.outputs[0].token_ids for o in state["f32"]] * 2
        return {"ok": got == want and pool["ok"], "kv_blocks": 8, "token_budget": 16,
                "requests": len(prompts), "same_as_ample_kv": got == want, "pool": pool}

    run.check("engine_under_pressure", pressure)
