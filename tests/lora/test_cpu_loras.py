"""max_cpu_loras: an engine with one adapter slot and two adapters kept read on the host, over
four adapters. Outputs against Hugging Face transformers running the base weights with each
adapter merged in by numpy; the host cache's bound, its pins (the adapters of requests still
queued or running) and its reads again, counted at the directory reader."""

from __future__ import annotations

import copy
import os
import shutil
from collections.abc import Iterator

import numpy as np
import pytest

from jaxllm import LoRARequest, SamplingParams
from jaxllm.engine.arg_utils import EngineArgs
from tests.lora_adapters import ATTENTION_MODULES, write_adapter
from tests.utils import core_of, make_llm, make_tiny_checkpoint, on_each_step, random_prompts

torch = pytest.importorskip("torch", reason="the oracle is Hugging Face transformers (torch)")

MAX_NEW = 6
MAX_CPU_LORAS = 2


def _merged_model(base, merged: dict):
    """The HF model with the adapter merged into its weights, by numpy."""
    model = copy.deepcopy(base)
    state = model.state_dict()
    for (i, parent, m), (a, b, scale) in merged.items():
        key = f"model.layers.{i}.{parent}.{m}.weight"
        state[key] = torch.from_numpy((state[key].numpy() + scale * (b @ a)).astype(np.float32))
    model.load_state_dict(state)
    return model.eval()


def _hf_greedy(model, prompt: list[int]) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(MAX_NEW):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    base_dir = tmp_path_factory.mktemp("base")
    hf = make_tiny_checkpoint(base_dir, tied=False).eval()
    root = tmp_path_factory.mktemp("adapters")
    targets = ATTENTION_MODULES + ("gate_proj", "up_proj", "down_proj")
    merged = {i: write_adapter(root / f"a{i}", hf.config, rank=4, alpha=8, targets=targets,
                               seed=10 + i) for i in (1, 2, 3, 4)}
    llm = make_llm(base_dir, enable_lora=True, max_loras=1, max_cpu_loras=MAX_CPU_LORAS,
                   max_lora_rank=8, dtype="float32", multiprocess_mode=False)
    yield {"base_dir": base_dir, "root": root, "llm": llm, "hf": hf,
           "requests": {i: LoRARequest(f"a{i}", i, str(root / f"a{i}")) for i in merged},
           "oracles": {i: _merged_model(hf, m) for i, m in merged.items()}}
    llm.shutdown()


@pytest.fixture
def reads(setup, monkeypatch) -> Iterator[dict[str, list[str]]]:
    """Each directory read, by the frontend's check and by the engine core's slots."""
    import jaxllm.engine.processor as processor
    import jaxllm.lora.slots as slots

    out: dict[str, list[str]] = {"frontend": [], "core": []}
    for where, module in (("frontend", processor), ("core", slots)):
        real = module.load_adapter

        def counted(path, *args, _real=real, _seen=out[where]):
            _seen.append(os.path.basename(path))
            return _real(path, *args)

        monkeypatch.setattr(module, "load_adapter", counted)
    yield out


def _slots(setup):
    slots = core_of(setup["llm"]).runner.lora_slots
    assert slots is not None
    return slots


def _params() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


def _run(setup, prompts: list[list[int]], ids: list[int]) -> None:
    """Generate with these adapters and check each output against its merged model."""
    outs = setup["llm"].generate([{"prompt_token_ids": p} for p in prompts], _params(),
                                 use_tqdm=False,
                                 lora_request=[setup["requests"][i] for i in ids])
    for prompt, lid, out in zip(prompts, ids, outs, strict=True):
        assert out.outputs[0].token_ids == _hf_greedy(setup["oracles"][lid], prompt), lid


def _start_with(setup, ids: tuple[int, int]) -> None:
    """The host caches hold exactly `ids`, the last one most recently named."""
    for i in ids:
        _run(setup, random_prompts(i, [3]), [i])
    assert list(_slots(setup).adapters) == list(ids)


def test_adapters_named_in_turn_are_dropped_least_recently_used_first_and_read_again(
        setup, reads):
    _start_with(setup, (3, 4))
    reads["frontend"].clear()
    reads["core"].clear()
    order = [1, 2, 1, 3, 4, 2]
    held = []
    for n, lid in enumerate(order):
        _run(setup, random_prompts(20 + n, [7]), [lid])
        held.append(list(_slots(setup).adapters))
    # Two kept: 1, named again after 2, stays when 3 comes and 2 goes; 2 is read again at
    # its next request.
    assert held == [[4, 1], [1, 2], [2, 1], [1, 3], [3, 4], [4, 2]]
    assert reads["core"] == ["a1", "a2", "a3", "a4", "a2"]
    assert reads["frontend"] == ["a1", "a2", "a3", "a4", "a2"]
    # The adapters differ: each check above compares against its own merged model.
    prompt = random_prompts(30, [7])[0]
    assert len({tuple(_hf_greedy(setup["oracles"][i], prompt)) for i in (1, 2, 3, 4)}) == 4


def test_adapters_of_queued_requests_stay_read_and_the_cache_shrinks_after(setup, reads):
    _start_with(setup, (3, 4))
    reads["core"].clear()
    slots, core = _slots(setup), core_of(setup["llm"])
    missing: list[tuple[str, int]] = []
    sizes: list[int] = []

    def record(so):
        sizes.append(len(slots.adapters))
        missing.extend((rid, r.lora_int_id) for rid, r in core.scheduler.requests.items()
                       if r.lora_int_id and r.lora_int_id not in slots.adapters)

    ids = [1, 2, 3, 4, 1, 3, 2]  # one slot: all but one adapter's requests wait
    on_each_step(setup["llm"], record)
    try:
        _run(setup, random_prompts(40, [5, 9, 6, 4, 8, 3, 7]), ids)
    finally:
        core.runner.__dict__.pop("prepare", None)
    assert missing == []
    # Above the bound while four adapters have unfinished requests, rather than refusing any.
    assert sizes[0] == 4
    assert len(slots.adapters) <= MAX_CPU_LORAS
    # Each read once (3 and 4, unpinned then, made room for 1 and 2): the requests naming one
    # again found it kept for the queued ones.
    assert reads["core"] == ["a1", "a2", "a3", "a4"]


def test_aborted_requests_release_their_adapters(setup):
    _start_with(setup, (3, 4))
    engine = setup["llm"].llm_engine
    for i in (1, 2, 3, 4):
        engine.add_request(f"abort-{i}", {"prompt_token_ids": [1, 2, 3]}, _params(),
                           lora_request=setup["requests"][i])
    assert len(_slots(setup).adapters) == 4
    engine.abort_request([f"abort-{i}" for i in (1, 2, 3, 4)])
    assert not engine.has_unfinished_requests()
    assert len(_slots(setup).adapters) == MAX_CPU_LORAS
    _run(setup, random_prompts(50, [6]), [1])  # and the engine serves on


def test_a_dropped_adapter_is_read_from_its_directory_and_keeps_its_id(setup, tmp_path, reads):
    llm, cfg = setup["llm"], setup["hf"].config
    merged = write_adapter(tmp_path / "x", cfg, rank=4, alpha=8, targets=("q_proj", "v_proj"),
                           seed=77)
    x = LoRARequest("x", 7, str(tmp_path / "x"))
    prompt = random_prompts(60, [6])[0]

    def generate(lora: LoRARequest) -> list[int]:
        out = llm.generate({"prompt_token_ids": prompt}, _params(), use_tqdm=False,
                           lora_request=lora)
        return out[0].outputs[0].token_ids

    assert generate(x) == _hf_greedy(_merged_model(setup["hf"], merged), prompt)
    _start_with(setup, (3, 4))  # x dropped by both caches
    # Rewritten with other weights: under its id the directory is read again ...
    rewritten = write_adapter(tmp_path / "x", cfg, rank=4, alpha=8,
                              targets=("q_proj", "v_proj"), seed=78)
    reads["core"].clear()
    assert generate(LoRARequest("x2", 8, str(tmp_path / "x"))) == _hf_greedy(
        _merged_model(setup["hf"], rewritten), prompt)
    assert reads["core"] == ["x"]
    # ... and id 7 still names that directory though no cache holds it: another one is
    # refused, as it is while the adapter is read.
    assert 7 not in _slots(setup).adapters
    reads["frontend"].clear()
    reads["core"].clear()
    with pytest.raises(ValueError, match="lora_int_id 7 is already adapter 'x'"):
        generate(LoRARequest("y", 7, str(setup["root"] / "a1")))
    assert reads == {"frontend": [], "core": []}  # refused by the frontend, unread
    # Gone from disk once dropped: the next request for it is refused by name.
    _start_with(setup, (3, 4))
    shutil.rmtree(tmp_path / "x")
    with pytest.raises(ValueError, match="does not exist"):
        generate(x)
    _run(setup, [prompt], [2])


def test_max_cpu_loras_is_checked_resolved_and_described(setup):
    with pytest.raises(ValueError, match=r"max_cpu_loras \(1\) must be >= max_loras \(2\)"):
        EngineArgs(enable_lora=True, max_loras=2, max_cpu_loras=1)
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="max_cpu_loras must be a positive integer or "
                                             "None"):
            EngineArgs(enable_lora=True, max_cpu_loras=bad)  # type: ignore[arg-type]
    assert EngineArgs(model=str(setup["base_dir"]), enable_lora=True, max_loras=3
                      ).create_engine_config().max_cpu_loras == 3
    assert EngineArgs(model=str(setup["base_dir"]), enable_lora=True, max_loras=3,
                      max_cpu_loras=5).create_engine_config().max_cpu_loras == 5
    assert setup["llm"].llm_engine.describe()["lora"] == {
        "max_loras": 1, "max_lora_rank": 8, "max_cpu_loras": MAX_CPU_LORAS}
    assert _slots(setup).max_cpu_loras == MAX_CPU_LORAS
