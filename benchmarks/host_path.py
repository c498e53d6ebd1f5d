"""Host cost per decode step, by phase, on a tiny Qwen2 (2 layers, hidden 64) with the real
151,936-token vocabulary and tokenizer: the device step is nearly free, as on a GPU, so what is
left is ours. Then a cProfile of the same steps.

    python benchmarks/host_path.py [REPO_ROOT] [BATCH]   (defaults: this checkout, 64)
"""
import cProfile
import io
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

bs = int(sys.argv[2]) if len(sys.argv) > 2 else 64
llm = LLM(model=str(path), max_num_seqs=bs, max_num_batched_tokens=max(512, bs),
          max_model_len=1024, show_progress=False)
engine = llm.llm_engine
rng = np.random.default_rng(0)
sp = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)
for i in range(bs):
    engine.add_request(f"r{i}", {"prompt_token_ids": rng.integers(100, 5000, 64).tolist()}, sp)
while True:
    engine.step()
    st = engine.last_scheduler_stats
    if st.num_decode_tokens == bs and not st.num_prefill_tokens:
        break
for _ in range(5):
    engine.step()
N = 40
walls, parts = [], []
for _ in range(N):
    t = time.perf_counter()
    engine.step()
    walls.append(time.perf_counter() - t)
    st = engine.last_scheduler_stats
    parts.append((st.schedule_s, st.prepare_s, st.device_s, st.transfer_s, st.sample_s,
                  st.update_s, engine.last_output_processing_s))
p = np.mean(parts, axis=0) * 1e3
wall = np.mean(walls) * 1e3
names = ["schedule", "prepare", "device", "transfer", "sample", "update", "detok"]
print(f"batch {bs}: step {wall:.2f} ms; "
      + ", ".join(f"{n} {v:.2f}" for n, v in zip(names, p, strict=True))
      + f"; other {wall - p.sum():.2f}")
pr = cProfile.Profile()
pr.enable()
for _ in range(N):
    engine.step()
pr.disable()
s = io.StringIO()
pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25)
print(s.getvalue()[:6000])
engine.abort_request([f"r{i}" for i in range(bs)])
