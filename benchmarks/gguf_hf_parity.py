"""quantization="gguf" on the embedded model against transformers on the same GGUF: greedy
tokens of tests/model/test_real_model.py's prompts, batched (decode buckets 2 and 4: the quantized
GEMVs) and each alone (bucket 1). Not in the test suite: a second 0.5B engine beside the
suite's shared one would pass its memory budget.

    PYTHONPATH=. .venv/bin/python benchmarks/gguf_hf_parity.py
"""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from jaxllm import LLM, SamplingParams
from jaxllm.model_executor.model_loader.default_model import default_model_path
from tests.model.test_real_model import PROMPTS


def main() -> None:
    path = default_model_path()
    llm = LLM(model=str(path), quantization="gguf", max_num_seqs=4, max_num_batched_tokens=64,
              show_progress=False)
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                              dtype=torch.float32).eval()
    tok, eos = llm.tokenizer, sorted(llm.llm_engine.eos_token_ids)
    sp = SamplingParams(temperature=0, max_tokens=32)
    batched = llm.generate(PROMPTS, sp, use_tqdm=False)
    same = 0
    for prompt, out in zip(PROMPTS, batched, strict=True):
        alone = llm.generate([prompt], sp, use_tqdm=False)[0]
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            ref = hf.generate(ids, max_new_tokens=32, do_sample=False, eos_token_id=eos)
        want = ref[0, ids.shape[1]:].tolist()
        ok = out.outputs[0].token_ids == want and alone.outputs[0].token_ids == want
        same += ok
        print(f"{'same' if ok else 'DIFFERENT'}: {prompt[:40]!r} -> {out.outputs[0].text[:60]!r}")
    counts = llm.collective_rpc("get_step_shape_counts")
    print(f"{same}/{len(PROMPTS)} prompts: greedy tokens identical to HF, batched and alone; "
          f"step shapes run (num_tokens, max_query_len, steps) {counts}")


if __name__ == "__main__":
    main()
