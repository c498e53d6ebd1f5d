"""What the data-parallel tests share: the engine settings, prompts and sampling parameters,
the one-core reference they compare with, and process helpers."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import psutil

from jaxllm import LLM, SamplingParams
from jaxllm.engine.dp_client import DPLBClient

ENGINE: dict[str, Any] = dict(max_model_len=128, max_num_seqs=32, max_num_batched_tokens=128,
                              num_kv_blocks=256, show_progress=False)
MAX_TOKENS = 8
_rng = np.random.default_rng(7)
# Distinct prompts (none shares a full block with another) and a prefix of three full blocks.
PROMPTS = [_rng.integers(100, 20000, n).tolist() for n in (3, 70, 17, 40, 9, 33, 20, 5)]
PREFIX = _rng.integers(100, 20000, 48).tolist()


def params(i: int) -> SamplingParams:
    """Greedy for even i, seeded sampling for odd i."""
    return SamplingParams(temperature=0 if i % 2 == 0 else 1.0, seed=None if i % 2 == 0 else i,
                          max_tokens=MAX_TOKENS, ignore_eos=True)


def token_prompt(ids: list[int]) -> dict:
    return {"prompt_token_ids": ids}


def reference_runner():
    """A module fixture's body (`yield from`): one core, in this process, and a function giving
    the tokens (and text) every data-parallel run must give."""
    llm = LLM("tiny-qwen2", multiprocess_mode=False, **ENGINE)
    cache: dict[tuple, tuple[list[int], str]] = {}

    def run(prompts: list[list[int]], sps: list[SamplingParams]) -> list[tuple[list[int], str]]:
        missing = [(p, sp) for p, sp in zip(prompts, sps, strict=True)
                   if (tuple(p), repr(sp)) not in cache]
        if missing:
            outs = llm.generate([token_prompt(p) for p, _ in missing], [sp for _, sp in missing],
                                use_tqdm=False)
            for (p, sp), o in zip(missing, outs, strict=True):
                cache[tuple(p), repr(sp)] = (list(o.outputs[0].token_ids), o.outputs[0].text)
        return [cache[tuple(p), repr(sp)] for p, sp in zip(prompts, sps, strict=True)]

    yield run
    llm.llm_engine.shutdown()


def routed(client: DPLBClient) -> list[int]:
    return [e.num_routed for e in client.engine_states()]


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def core_children(process: psutil.Process, recursive: bool = False) -> list[int]:
    """Pids of `process`'s live engine-core children (a killed core not yet reaped is a zombie,
    whose command line cannot be read: not a live core)."""
    pids = []
    for child in process.children(recursive=recursive):
        try:
            if "jaxllm.engine.core_proc" in " ".join(child.cmdline()):
                pids.append(child.pid)
        except psutil.Error:
            pass
    return pids


def wait_until(cond, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


async def collect(engine, prompt: list[int], sp: SamplingParams, rid: str
                  ) -> tuple[list[int], str]:
    """One AsyncLLM request to its end: its tokens and text."""
    last = None
    async for out in engine.generate(token_prompt(prompt), sp, rid):
        last = out
    assert last is not None and last.finished
    return list(last.outputs[0].token_ids), last.outputs[0].text
