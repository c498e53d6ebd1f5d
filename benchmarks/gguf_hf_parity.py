"""quantization="gguf" on the embedded model against transformers on the same GGUF: greedy
tokens of tests/model/test_real_model.py's prompts, batched (decode buckets 2 and 4: the quantized
GEMVs) and each alone (bucket 1). Not in the test suite: a second 0.5B engine beside the
suite's shared one would pass its memory budget.

    PYTHONPATH=. .venv/bin/python benchmarks/gguf_hf_parity.py [--cpu-int8-activations]

With `--cpu-int8-activations` (int8 activations: not exact) it also counts the tokens before the
first difference and the largest gap between each of our tokens' logprob and HF's for it
(HF run on our tokens).
"""

from __future__ import annotations

import argparse

import torch
from transformers import AutoModelForCausalLM

from jaxllm import LLM, SamplingParams
from jaxllm.model_executor.model_loader.default_model import default_model_path
from tests.model.test_real_model import PROMPTS


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cpu-int8-activations", action="store_true")
    int8 = ap.parse_args().cpu_int8_activations
    path = default_model_path()
    llm = LLM(model=str(path), quantization="gguf", max_num_seqs=4, max_num_batched_tokens=64,
              show_progress=False, cpu_int8_activations=int8)
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                              dtype=torch.float32).eval()
    tok, eos = llm.tokenizer, sorted(llm.llm_engine.eos_token_ids)
    sp = SamplingParams(temperature=0, max_tokens=32, logprobs=0)
    batched = llm.generate(PROMPTS, sp, use_tqdm=False)
    same = agreeing = total = 0
    gap = 0.0
    for prompt, out in zip(PROMPTS, batched, strict=True):
        alone = llm.generate([prompt], sp, use_tqdm=False)[0]
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            ref = hf.generate(ids, max_new_tokens=32, do_sample=False, eos_token_id=eos)
        want = ref[0, ids.shape[1]:].tolist()
        ok = out.outputs[0].token_ids == want and alone.outputs[0].token_ids == want
        same += ok
        ours = out.outputs[0].token_ids
        agreeing += next((i for i, (a, b) in enumerate(zip(ours, want, strict=False)) if a != b),
                         min(len(ours), len(want)))
        total += len(want)
        with torch.no_grad():
            logp = torch.log_softmax(hf(torch.cat([ids, torch.tensor([ours])], 1)).logits[0]
                                     .double(), -1)
        for i, t in enumerate(ours):
            theirs = logp[ids.shape[1] - 1 + i, t].item()
            gap = max(gap, abs(out.outputs[0].logprobs[i][t].logprob - theirs))
        print(f"{'same' if ok else 'DIFFERENT'}: {prompt[:40]!r} -> {out.outputs[0].text[:60]!r}")
    counts = llm.collective_rpc("get_step_shape_counts")
    print(f"{same}/{len(PROMPTS)} prompts: greedy tokens identical to HF, batched and alone; "
          f"step shapes run (num_tokens, max_query_len, steps) {counts}")
    print(f"{agreeing}/{total} of HF's tokens before the first difference (batched); largest "
          f"|logprob - HF's| of our tokens {gap:.4f}")


if __name__ == "__main__":
    main()
