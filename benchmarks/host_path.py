"""Host cost per decode step, by phase, on a tiny Qwen2 (2 layers, hidden 64) with the real
151,936-token vocabulary and tokenizer: the device step is nearly free, as on a GPU, so what is
left is ours. Then a cProfile of the same steps.

    python benchmarks/host_path.py [REPO_ROOT] [BATCH] [sync|async] [topk|full] [greedy|seeded]
    (defaults: this checkout, 64, async, topk, greedy; seeded = seeded top_k 50 + top_p 0.9)
"""
import cProfile
import io
import os
import pstats
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, sys.argv[1] if len(sys.argv) > 1 else str(Path(__file__).resolve().parents[1]))
path = Path(tempfile.gettempdir()) / "jaxllm_tiny_real_vocab"
if not (path / "config.json").exists():
    import torch
    import transformers

    from jaxllm.model_executor.model_loader.default_model import default_model_path
    from jaxllm.model_executor.model_loader.tokenizer import load_tokenizer
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(vocab_size=151936, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=4096,
                                   tie_word_embeddings=True)
    transformers.Qwen2ForCausalLM(cfg).save_pretrained(path)
    load_tokenizer(default_model_path()).save_pretrained(path)

from jaxllm import LLM, SamplingParams  # noqa: E402 (after the sys.path entry)

argv = sys.argv[2:] + [""] * 4
bs = int(argv[0] or 64)
async_on = argv[1] != "sync"
topk_on = argv[2] != "full"
seeded = argv[3] == "seeded"
llm = LLM(model=str(path), max_num_seqs=bs, max_num_batched_tokens=max(512, bs),
          max_model_len=1024, show_progress=False, async_scheduling=async_on,
          topk_sampling=topk_on)
engine = llm.llm_engine
rng = np.random.default_rng(0)
for i in range(bs):
    sp = (SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=i, max_tokens=500,
                         ignore_eos=True) if seeded
          else SamplingParams(temperature=0, max_tokens=500, ignore_eos=True))
    engine.add_request(f"r{i}", {"prompt_token_ids": rng.integers(100, 5000, 64).tolist()}, sp)
while True:
    engine.step()
    st = engine.last_scheduler_stats
    if st.num_decode_tokens == bs and not st.num_prefill_tokens:
        break
for _ in range(5):
    engine.step()
N = 40
walls, parts, critical = [], [], []
for _ in range(N):
    t = time.perf_counter()
    engine.step()
    walls.append(time.perf_counter() - t)
    st = engine.last_scheduler_stats
    parts.append((st.schedule_s, st.prepare_s, st.device_s, st.transfer_s, st.sample_s,
                  st.update_s, engine.last_output_processing_s))
    critical.append(st.host_critical_s)
p = np.mean(parts, axis=0) * 1e3
wall = np.mean(walls) * 1e3
names = ["schedule", "prepare", "device", "transfer", "sample", "update", "detok"]
mode = (f"{'async' if async_on else 'sync'}, {'top-K' if topk_on else 'full rows'}, "
        f"{'seeded top_k 50 + top_p 0.9' if seeded else 'greedy'}, {os.cpu_count()} cpus")
print(f"batch {bs} ({mode}): step {wall:.2f} ms; "
      + ", ".join(f"{n} {v:.2f}" for n, v in zip(names, p, strict=True))
      + (f"; host_critical {1e3 * np.mean(critical):.2f} (median "
         f"{1e3 * np.median(critical):.2f})" if async_on else f"; other {wall - p.sum():.2f}"))
pr = cProfile.Profile()
pr.enable()
for _ in range(N):
    engine.step()
pr.disable()
s = io.StringIO()
pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25)
print(s.getvalue()[:6000])
engine.abort_request([f"r{i}" for i in range(bs)])
