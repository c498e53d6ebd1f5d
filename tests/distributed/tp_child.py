"""Run in a child process by test_tensor_parallel.py, with virtual CPU devices (XLA_FLAGS must be
set before JAX starts): one engine per TP size over one checkpoint, the same greedy requests
each, and what the parent compares saved to an .npz (every step's full logits, the sampled
top-K, tokens, prompt logprobs, shardings, compiles after warm-up).

usage: python tests/distributed/tp_child.py CHECKPOINT OUT.npz TP_SIZE[,TP_SIZE...] [KWARGS_JSON]
       python tests/distributed/tp_child.py --real OUT.npz TP_SIZE
           (the embedded 0.5B model, REAL_PROMPTS with few KV blocks: preemption and prefix-cache
           hits)
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np

PROMPTS = [[5, 6, 7, 8], list(range(10, 40)), [3] * 17]
MAX_NEW = 6
_PREFIX = ("You are a careful Python reviewer. Read the function below and explain, step by "
           "step, what it computes and how it could fail.\n\n")
REAL_PROMPTS = [_PREFIX + "def mean(xs):\n    return sum(xs) / len(xs)\n",
                _PREFIX + "def first(xs):\n    return xs[0]\n",
                _PREFIX + "def parse(s):\n    return int(s)\n",
                "The history of the printing press begins"]
REAL_MAX_NEW = 24
REAL_ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=64)  # as the real_llm fixture


def run_real(tp: int) -> dict[str, np.ndarray]:
    """Greedy REAL_PROMPTS on the embedded model: the first prompt alone (its prefix blocks
    then hit the cache), then all of them with 12 KV blocks (preemption)."""
    from jaxllm import LLM, SamplingParams
    from tests.utils import scheduler_state

    llm = LLM(tensor_parallel_size=tp, num_kv_blocks=12, show_progress=False, **REAL_ENGINE)
    sp = SamplingParams(temperature=0, max_tokens=REAL_MAX_NEW, ignore_eos=True)
    first = llm.generate(REAL_PROMPTS[:1], sp, use_tqdm=False)
    outs = llm.generate(REAL_PROMPTS, sp, use_tqdm=False)
    return {"tokens": np.array([o.outputs[0].token_ids for o in first + outs]),
            "num_cached_tokens": np.array([o.num_cached_tokens for o in outs]),
            "num_preemptions": np.array(scheduler_state(llm)["num_preemptions"])}


def run(path: str, tp: int, engine_kw: dict) -> dict[str, np.ndarray]:
    import jax

    from jaxllm import LLM, SamplingParams
    from tests.utils import runner_of

    # In process: every step's full logits and the arrays' shardings are read from the runner.
    kw = dict(skip_tokenizer_init=True, max_model_len=128, max_num_seqs=4,
              max_num_batched_tokens=32, num_kv_blocks=64, show_progress=False,
              topk_sampling=True, multiprocess_mode=False)
    kw.update(engine_kw)
    t0 = time.perf_counter()
    llm = LLM(model=path, tensor_parallel_size=tp, **kw)
    t1 = time.perf_counter()
    runner = runner_of(llm)
    steps = []
    original_wait = runner.wait

    def wait(handle):
        out = original_wait(handle)
        n = len(out.sample_req_ids)
        steps.append((np.asarray(out.handle.logits)[:n].copy(), out.topk))
        return out

    runner.wait = wait
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda name, *a, **k: compiles.append(name) if "backend_compile" in name else None)
    sp = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, prompt_logprobs=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False)
    warm_compiles = len(compiles)
    jax.jit(lambda x: x * 3)(np.float32(1))  # the listener sees a compile when there is one
    res = {"tokens": np.array([o.outputs[0].token_ids for o in outs]),
           "control_compiles": np.array(len(compiles) - warm_compiles),
           "logits": np.concatenate([s[0] for s in steps]),
           "compiles_after_warmup": np.array(warm_compiles)}
    if steps[0][1] is not None:
        res["topk_values"] = np.concatenate([s[1].values for s in steps])
        res["topk_ids"] = np.concatenate([s[1].token_ids for s in steps])
        res["topk_lse"] = np.concatenate([s[1].lse for s in steps])
    res["prompt_logprobs"] = np.array([
        [lp[tok].logprob for lp, tok in zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:],
                                            strict=True)] for o in outs[:1]])
    print(f"tp={tp}: start-up {t1 - t0:.1f} s, generate {time.perf_counter() - t1:.1f} s",
          file=sys.stderr)
    kv = runner.kv_cache
    res["kv_shape"] = np.array(kv.shape)
    res["kv_shard_shape"] = np.array(kv.sharding.shard_shape(kv.shape))
    res["kv_num_devices"] = np.array(len(kv.sharding.device_set))
    # Per-shard shapes of the weights the fused layout has (every family's, where it has them).
    layer = runner.params["layers_0"]
    for block, names in (("self_attn", ("qkv_proj", "o_proj")),
                         ("mlp", ("gate_up_proj", "down_proj"))):
        for name in names:
            if name in layer.get(block, {}):
                w = layer[block][name]["weight"]
                res[f"{name}_shard_shape"] = np.array(w.sharding.shard_shape(w.shape))
    experts = layer.get("mlp", {}).get("experts")
    if experts is not None:  # an MoE layer's stacked experts
        for name, w in (("gate_up", experts["gate_up_proj"]), ("down", experts["down_proj"])):
            res[f"experts_{name}_shard_shape"] = np.array(w.sharding.shard_shape(w.shape))
    w = runner.params["embed_tokens"]
    res["embed_shard_shape"] = np.array(w.sharding.shard_shape(w.shape))
    llm.llm_engine.shutdown() if hasattr(llm.llm_engine, "shutdown") else None
    return res


def main() -> None:
    if sys.argv[1] == "--real":
        np.savez(sys.argv[2], **run_real(int(sys.argv[3])))
        return
    path, out, sizes = sys.argv[1], sys.argv[2], [int(x) for x in sys.argv[3].split(",")]
    engine_kw = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}
    results = {}
    for tp in sizes:
        for key, value in run(path, tp, engine_kw).items():
            results[f"tp{tp}_{key}"] = value
    np.savez(out, **results)


if __name__ == "__main__":
    main()
