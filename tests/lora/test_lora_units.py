"""LoRA's parts that need no model: the engine settings refused, the request on the wire to a
core process, the prefix cache's adapter key, the server's `--lora-modules` names, the device
slots' one-slot writes, a fused target's place in them (Phi-3), the adapters kept read on the
host (max_cpu_loras, pinned by unfinished requests), which families and modules an adapter may
target, and which paths name one adapter (the engine tests, against Hugging Face, are
test_lora.py's and test_cpu_loras.py's)."""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm import LoRARequest, SamplingParams
from jaxllm.engine import EngineCoreRequest
from jaxllm.engine.arg_utils import EngineArgs
from jaxllm.engine.serial_utils import MsgpackDecoder, MsgpackEncoder
from jaxllm.lora.adapter import check_lora_model, load_adapter, module_dims
from jaxllm.lora.request import check_same_adapter
from jaxllm.lora.slots import LoRASlots
from jaxllm.model_executor.config import ModelConfig
from jaxllm.worker.compile_counter import compile_count
from scheduler.block_pool import hash_block_tokens
from tests.lora_adapters import (
    ATTENTION_MODULES,
    FUSED_ATTENTION_MODULES,
    FUSED_MLP_MODULES,
    write_adapter,
)


def _params() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=0)


def test_engine_settings_lora_refuses():
    with pytest.raises(ValueError, match="tensor_parallel_size > 1"):
        EngineArgs(enable_lora=True, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="runner='pooling'"):
        EngineArgs(enable_lora=True, runner="pooling")
    # Speculative decoding combines with adapters (the draft model runs without them).
    EngineArgs(enable_lora=True, speculative_config={"method": "ngram",
                                                     "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="max_lora_rank must be a positive integer"):
        EngineArgs(enable_lora=True, max_lora_rank=0)
    with pytest.raises(ValueError, match=r"max_cpu_loras \(2\) must be >= max_loras \(3\)"):
        EngineArgs(enable_lora=True, max_loras=3, max_cpu_loras=2)


def test_lora_request_travels_to_a_core_process():
    req = EngineCoreRequest(request_id="r", prompt_token_ids=[1, 2], sampling_params=_params(),
                            eos_token_ids=[0], max_tokens=4,
                            lora_request=LoRARequest("a", 7, "/x"))
    back = MsgpackDecoder(EngineCoreRequest).decode(MsgpackEncoder().encode(req))
    assert back.lora_request == LoRARequest("a", 7, "/x")


def test_block_hash_keys_on_the_adapter():
    tokens = list(range(16))
    assert hash_block_tokens(None, tokens, 0) == hash_block_tokens(None, tokens)
    assert len({hash_block_tokens(None, tokens, i) for i in (0, 1, 2)}) == 3


def test_server_lora_modules_name_models():
    from types import SimpleNamespace

    from jaxllm.entrypoints.cli.serve import parse_lora_modules
    from jaxllm.entrypoints.openai.protocol import APIError
    from jaxllm.entrypoints.openai.serving_engine import OpenAIServing

    mods = parse_lora_modules(["sql=/adapters/sql", "chat=/adapters/chat"])
    assert [(m.lora_name, m.lora_int_id) for m in mods.values()] == [("sql", 1), ("chat", 2)]
    for bad in (["nopath"], ["a=/x", "a=/y"]):
        with pytest.raises(ValueError, match="--lora-modules"):
            parse_lora_modules(bad)
    serving = SimpleNamespace(model_name="base", lora_modules=mods)
    assert OpenAIServing.check_model(serving, None) is None
    assert OpenAIServing.check_model(serving, "base") is None
    assert OpenAIServing.check_model(serving, "chat") == mods["chat"]
    assert OpenAIServing.response_model(serving, "chat") == "chat"
    assert OpenAIServing.response_model(serving, None) == "base"
    with pytest.raises(APIError, match="`base`, `sql`, `chat`"):
        OpenAIServing.check_model(serving, "other")


# --- the device slots ---------------------------------------------------------------------------

MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
# q 16, kv 8, intermediate 24: every fused part a different width.
TINY = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=4,
                   architecture="LlamaForCausalLM", attention_bias=False)
RANK = 8


def _expected_slot(cfg: ModelConfig, merged: dict) -> dict:
    """The slot an adapter fills, built from PEFT's A, B and scale: per layer and fused
    projection, part p's A^T in columns [p*RANK, p*RANK + r) of A [in, parts*RANK], its
    (scale*B)^T in those rows of B and its own output columns, zeros elsewhere."""
    h, q, kv, inter = cfg.hidden_size, 16, 8, cfg.intermediate_size
    # module -> (fused, part, first output column)
    place = {"q_proj": ("qkv_proj", 0, 0), "k_proj": ("qkv_proj", 1, q),
             "v_proj": ("qkv_proj", 2, q + kv), "o_proj": ("o_proj", 0, 0),
             "gate_proj": ("gate_up_proj", 0, 0), "up_proj": ("gate_up_proj", 1, inter),
             "down_proj": ("down_proj", 0, 0)}
    shapes = {"qkv_proj": (h, 3, q + 2 * kv), "o_proj": (q, 1, h),
              "gate_up_proj": (h, 2, 2 * inter), "down_proj": (inter, 1, h)}
    out = {f"layers_{i}": {f: {"A": np.zeros((d_in, n * RANK), np.float32),
                               "B": np.zeros((n * RANK, d_out), np.float32)}
                           for f, (d_in, n, d_out) in shapes.items()}
           for i in range(cfg.num_hidden_layers)}
    for (i, _, m), (a, b, scale) in merged.items():
        fused, part, col = place[m]
        r = a.shape[0]
        w = out[f"layers_{i}"][fused]
        w["A"][:, part * RANK:part * RANK + r] = a.T
        w["B"][part * RANK:part * RANK + r, col:col + b.shape[0]] = (b * np.float32(scale)).T
    return out


def _adapters(tmp_path) -> dict[int, tuple[LoRARequest, dict]]:
    specs = {1: (RANK, ATTENTION_MODULES), 2: (4, ATTENTION_MODULES + MLP_MODULES),
             3: (2, ("v_proj",) + MLP_MODULES), 4: (3, ("k_proj", "up_proj", "o_proj"))}
    out = {}
    for i, (rank, targets) in specs.items():
        merged = write_adapter(tmp_path / f"a{i}", TINY, rank=rank, alpha=2 * rank + 1,
                               targets=targets, seed=i)
        out[i] = (LoRARequest(f"a{i}", i, str(tmp_path / f"a{i}")), merged)
    return out


def _host(tree: dict) -> dict:
    return jax.tree.map(lambda x: np.array(x, copy=True), tree)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_a_slot_load_rewrites_that_slot_and_leaves_the_others(tmp_path, dtype):
    adapters = _adapters(tmp_path)
    slots = LoRASlots(TINY, max_loras=3, max_lora_rank=RANK, dtype=dtype, max_cpu_loras=4)
    for lora, _ in adapters.values():
        slots.register(lora)
    assert [slots.activate(i, set()) for i in (1, 2, 3)] == [1, 2, 3]
    tree = slots.device_weights()
    # Copied on the device: a host view of the tree would keep its buffers from being reused.
    before = jax.tree.map(lambda x: jnp.array(x, copy=True), tree)
    buffers = [x.unsafe_buffer_pointer() for x in jax.tree.leaves(tree)]
    # Adapter 2 is the least recently activated one no live request reads.
    assert slots.activate(4, {1, 3}) == 2
    # In place: the new tree lives in the old one's buffers.
    assert [x.unsafe_buffer_pointer() for x in jax.tree.leaves(slots.device_weights())] \
        == buffers
    before, after = _host(before), _host(slots.device_weights())
    want = _expected_slot(TINY, adapters[4][1])
    for path, got in jax.tree_util.tree_leaves_with_path(after):
        old = before
        exp = want
        for key in path:
            old, exp = old[key.key], exp[key.key]
        assert got.dtype == np.dtype(dtype), path
        for k in (0, 2):  # bit for bit
            assert got[k].tobytes() == old[k].tobytes(), (path, k)
        assert got[1].tobytes() == exp.astype(dtype).tobytes(), path
    # Activating an adapter that has its slot writes nothing.
    tree = slots.device_weights()
    assert slots.activate(3, {1, 4}) == 3
    assert slots.device_weights() is tree


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_a_slot_load_sends_one_slot_through_one_executable(tmp_path, dtype, monkeypatch):
    adapters = _adapters(tmp_path)
    slots = LoRASlots(TINY, max_loras=2, max_lora_rank=RANK, dtype=dtype, max_cpu_loras=4)
    for lora, _ in adapters.values():
        slots.register(lora)
    tree = slots.device_weights()
    itemsize = np.dtype(dtype).itemsize
    h, q, kv, inter = 16, 16, 8, 24
    one_slot = TINY.num_hidden_layers * itemsize * RANK * (
        h * 3 + 3 * (q + 2 * kv) + q + h + h * 2 + 2 * 2 * inter + inter + h)
    sent: list[list[tuple[int, np.dtype]]] = []
    put = jax.device_put

    def record(x, *args, **kwargs):
        sent.append([(np.asarray(leaf).nbytes, np.asarray(leaf).dtype)
                     for leaf in jax.tree.leaves(x)])
        return put(x, *args, **kwargs)

    monkeypatch.setattr(jax, "device_put", record)
    compiles = compile_count()
    # Every implicit host-to-device copy refused: what crosses goes through device_put.
    with jax.transfer_guard_host_to_device("disallow"):
        order = [slots.activate(i, set()) for i in (1, 2, 3, 4, 1)]
    assert order == [1, 2, 1, 2, 1]
    assert compile_count() - compiles <= 1  # one executable for every slot
    assert len(sent) == 5
    for leaves in sent:
        arrays = [(n, dt) for n, dt in leaves if n > 4]  # besides the slot index
        assert sum(n for n, _ in arrays) == one_slot
        assert all(dt == np.dtype(dtype) for _, dt in arrays)
    # Written in place: the tree before the first load was donated to it.
    assert all(leaf.is_deleted() for leaf in jax.tree.leaves(tree))


def test_an_adapter_id_keeps_its_directory_under_another_spelling(tmp_path, monkeypatch):
    write_adapter(tmp_path / "a", TINY, rank=2, alpha=4, targets=("q_proj",), seed=1)
    write_adapter(tmp_path / "b", TINY, rank=2, alpha=4, targets=("q_proj",), seed=2)
    (tmp_path / "link").symlink_to(tmp_path / "a")
    monkeypatch.chdir(tmp_path)
    known = LoRARequest("a", 1, str(tmp_path / "a"))
    for path in (str(tmp_path / "a") + "/", "a", "./a/", str(tmp_path / "link"),
                 str(tmp_path / "b" / ".." / "a")):
        same = LoRARequest("a", 1, path)
        assert check_same_adapter(known, same), path
        assert same.lora_path == path  # kept as the user gave it
    for path in (str(tmp_path / "b"), "b", os.path.join("a", "..", "b")):
        with pytest.raises(ValueError, match="already adapter 'a'"):
            check_same_adapter(known, LoRARequest("b", 1, path))
    # The slots read the adapter once, whichever spelling comes later.
    slots = LoRASlots(TINY, max_loras=1, max_lora_rank=RANK, dtype=jnp.float32)
    slots.register(known)
    adapter = slots.adapters[1]
    slots.register(LoRARequest("a", 1, "a/"))
    assert slots.adapters[1] is adapter
    with pytest.raises(ValueError, match="already adapter 'a'"):
        slots.register(LoRARequest("b", 1, "b"))


def _count_reads(monkeypatch) -> list[str]:
    """The directories the slots read from now on, by name."""
    import jaxllm.lora.slots as slots_module

    reads: list[str] = []
    real = slots_module.load_adapter

    def counted(path, *args):
        reads.append(os.path.basename(path))
        return real(path, *args)

    monkeypatch.setattr(slots_module, "load_adapter", counted)
    return reads


def test_the_host_keeps_max_cpu_loras_adapters_least_recently_named_dropped_first(
        tmp_path, monkeypatch):
    adapters = _adapters(tmp_path)
    reads = _count_reads(monkeypatch)
    slots = LoRASlots(TINY, max_loras=1, max_lora_rank=RANK, dtype=jnp.float32,
                      max_cpu_loras=2)
    for i in (1, 2, 1, 3):
        slots.register(adapters[i][0])
    assert list(slots.adapters) == [1, 3]  # 2 named least recently
    assert reads == ["a1", "a2", "a3"]
    slots.register(adapters[2][0])
    assert reads[-1] == "a2"  # read again
    assert list(slots.adapters) == [3, 2]
    # Read again, it fills its slot as when first read.
    assert slots.activate(2, set()) == 1
    got = _host(slots.device_weights())
    want = _expected_slot(TINY, adapters[2][1])
    for path, leaf in jax.tree_util.tree_leaves_with_path(got):
        exp = want
        for key in path:
            exp = exp[key.key]
        np.testing.assert_allclose(leaf[0], exp, rtol=1e-6, err_msg=str(path))
    with pytest.raises(ValueError, match=r"max_cpu_loras \(1\) must be >= max_loras \(2\)"):
        LoRASlots(TINY, max_loras=2, max_lora_rank=RANK, dtype=jnp.float32, max_cpu_loras=1)
    assert LoRASlots(TINY, max_loras=3, max_lora_rank=RANK, dtype=jnp.float32
                     ).max_cpu_loras == 3


def test_adapters_of_unfinished_requests_are_never_dropped(tmp_path, monkeypatch):
    adapters = _adapters(tmp_path)
    reads = _count_reads(monkeypatch)
    slots = LoRASlots(TINY, max_loras=1, max_lora_rank=RANK, dtype=jnp.float32,
                      max_cpu_loras=2)
    for i in (1, 2, 3, 4):
        slots.register(adapters[i][0])
        slots.pin(f"r{i}", i)
    slots.pin("r1b", 1)  # a second request with adapter 1
    # Above the bound while every adapter has a request queued.
    assert list(slots.adapters) == [1, 2, 3, 4]
    slots.unpin(["r2", "unknown"])
    assert list(slots.adapters) == [1, 3, 4]
    slots.unpin(["r1", "r3"])  # 1 still has r1b
    assert list(slots.adapters) == [1, 4]
    slots.unpin(["r4"])
    assert list(slots.adapters) == [1, 4]
    # A new adapter takes the place of an unpinned one, never of a pinned one.
    slots.register(adapters[2][0])
    assert list(slots.adapters) == [1, 2]
    slots.unpin(["r1b"])
    slots.register(adapters[3][0])
    assert list(slots.adapters) == [2, 3]
    assert reads == ["a1", "a2", "a3", "a4", "a2", "a3"]


def test_an_adapter_dropped_from_the_host_runs_what_is_read_again_and_keeps_its_directory(
        tmp_path, monkeypatch):
    adapters = _adapters(tmp_path)
    reads = _count_reads(monkeypatch)
    slots = LoRASlots(TINY, max_loras=2, max_lora_rank=RANK, dtype=jnp.float32)
    slots.register(adapters[1][0])
    assert slots.activate(1, set()) == 1
    slots.register(adapters[2][0])
    slots.register(adapters[3][0])
    assert 1 not in slots.adapters and 1 not in slots.slot_of
    # Its directory rewritten meanwhile (adapter 4's files): its next request reads it again,
    # and the slot is loaded from that read, not left with the weights read first.
    path = Path(adapters[1][0].lora_path)
    shutil.rmtree(path)
    shutil.copytree(adapters[4][0].lora_path, path)
    slots.register(adapters[1][0])
    assert reads[-1] == "a1"
    slot = slots.activate(1, set())
    got = jax.tree.map(lambda x: np.asarray(x)[slot - 1], _host(slots.device_weights()))
    want = _expected_slot(TINY, adapters[4][1])
    for path_keys, leaf in jax.tree_util.tree_leaves_with_path(got):
        exp = want
        for key in path_keys:
            exp = exp[key.key]
        np.testing.assert_array_equal(leaf, exp, err_msg=str(path_keys))
    # Dropped again, id 1 still names its directory: another one under it is refused.
    slots.register(adapters[2][0])
    slots.register(adapters[3][0])
    assert 1 not in slots.adapters
    with pytest.raises(ValueError, match="lora_int_id 1 is already adapter 'a1'"):
        slots.register(LoRARequest("other", 1, adapters[4][0].lora_path))
    assert 1 not in slots.adapters and reads.count("a4") == 0


# Phi-4-mini's shape of Phi-3: head_dim 8 with partial_rotary_factor 0.75 rotates 6 dims of each
# q and k head; q 32 wide, k and v 16, intermediate 24.
PHI3 = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                   architecture="Phi3ForCausalLM", attention_bias=False,
                   partial_rotary_factor=0.75)
# One q or k head's dims in the order the RoPE kernels take them, from Hugging Face's: the
# rotated first half, the passed first half, the rotated second half, the passed second half.
PHI3_HEAD_ORDER = [0, 1, 2, 6, 3, 4, 5, 7]


def test_a_fused_phi3_adapter_fills_one_part_spanning_the_fused_outputs(tmp_path):
    """Phi-3's checkpoints, and so its adapters, hold q/k/v and gate/up fused: one rank-r A and
    a B over every output column per projection (not block-diagonal per part), B's q and k
    rows in the loader's partial-rotary order and its v rows as they are."""
    targets = FUSED_ATTENTION_MODULES + FUSED_MLP_MODULES
    merged = write_adapter(tmp_path / "a", PHI3, rank=3, alpha=5, targets=targets, seed=9)
    slots = LoRASlots(PHI3, max_loras=1, max_lora_rank=RANK, dtype=jnp.float32)
    tree = slots.slot_weights(load_adapter(tmp_path / "a", PHI3, RANK))
    h, qkv, inter = 16, 32 + 2 * 16, 24
    assert {f: (w["A"].shape, w["B"].shape) for f, w in tree["layers_0"].items()} == {
        "qkv_proj": ((h, RANK), (RANK, qkv)), "o_proj": ((32, RANK), (RANK, h)),
        "gate_up_proj": ((h, RANK), (RANK, 2 * inter)), "down_proj": ((inter, RANK), (RANK, h))}
    q_k_heads = 4 + 2
    rows = [8 * head + d for head in range(q_k_heads) for d in PHI3_HEAD_ORDER]
    rows += list(range(q_k_heads * 8, qkv))  # v
    for (i, _, m), (a, b, scale) in merged.items():
        w = tree[f"layers_{i}"][m]
        want_b = (b * np.float32(scale))[rows if m == "qkv_proj" else slice(None)]
        np.testing.assert_array_equal(w["A"][:, :3], a.T)
        np.testing.assert_array_equal(w["B"][:3], want_b.T)
        assert not w["A"][:, 3:].any() and not w["B"][3:].any()


def test_adapter_modules_are_the_checkpoints_own(tmp_path):
    # Phi-3's HF model has no q_proj or gate_proj for PEFT to wrap; the split families have no
    # qkv_proj or gate_up_proj.
    write_adapter(tmp_path / "split", PHI3, rank=2, alpha=4, targets=("q_proj",), seed=1)
    with pytest.raises(ValueError, match=r"targets self_attn\.q_proj.*Phi3ForCausalLM's"):
        load_adapter(tmp_path / "split", PHI3, RANK)
    write_adapter(tmp_path / "fused", TINY, rank=2, alpha=4, targets=("gate_up_proj",), seed=2)
    with pytest.raises(ValueError, match=r"targets mlp\.gate_up_proj.*LlamaForCausalLM's"):
        load_adapter(tmp_path / "fused", TINY, RANK)
    # Gemma's head_dim is its own, not hidden_size / num_attention_heads.
    gemma = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=24,
                        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=1,
                        head_dim=8, architecture="GemmaForCausalLM", attention_bias=False)
    assert module_dims(gemma) == {
        "q_proj": (16, 32), "k_proj": (16, 8), "v_proj": (16, 8), "o_proj": (32, 16),
        "gate_proj": (16, 24), "up_proj": (16, 24), "down_proj": (24, 16)}


@pytest.mark.parametrize("arch", ["Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM",
                                  "MixtralForCausalLM"])
def test_lora_refuses_mixtures_of_experts_by_name(arch):
    with pytest.raises(ValueError, match=f"{arch}: a mixture of experts"):
        check_lora_model(dataclasses.replace(TINY, architecture=arch))
    for dense in ("GemmaForCausalLM", "Gemma3ForCausalLM", "Olmo2ForCausalLM",
                  "GraniteForCausalLM", "Phi3ForCausalLM"):
        check_lora_model(dataclasses.replace(TINY, architecture=dense))


def test_reading_an_adapter_loads_no_jax(tmp_path):
    """The frontend's Processor reads each new adapter to check it: that must not import JAX
    (a multiprocess frontend never does), Phi-3's fused targets and row order included."""
    import subprocess
    import sys

    phi3 = dataclasses.replace(TINY, architecture="Phi3ForCausalLM", partial_rotary_factor=0.5)
    write_adapter(tmp_path / "a", phi3, rank=2, alpha=4, targets=("qkv_proj",), seed=1)
    code = ("import sys, dataclasses\n"
            "from jaxllm.model_executor.config import ModelConfig\n"
            "from jaxllm.lora.adapter import load_adapter\n"
            f"cfg = ModelConfig(**{dataclasses.asdict(phi3)!r})\n"
            f"adapter = load_adapter({str(tmp_path / 'a')!r}, cfg, 4)\n"
            "assert adapter.weights\n"
            "bad = sorted(m for m in sys.modules if m == 'jax' or m.startswith('jax.'))\n"
            "assert not bad, bad[:5]\n")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": root})
    assert proc.returncode == 0, proc.stderr[-2000:]


@pytest.mark.parametrize("extra, words", [
    ({"layer_replication": [[0, 2]]}, "layer_replication"),
    ({"alora_invocation_tokens": [5, 6]}, "alora_invocation_tokens"),
    ({"init_lora_weights": "pissa_niter_4"}, "convert the adapter to plain LoRA"),
    ({"init_lora_weights": "olora"}, "convert the adapter to plain LoRA"),
])
def test_adapters_the_step_would_misapply_are_refused_by_name(tmp_path, extra, words):
    write_adapter(tmp_path / "a", TINY, rank=2, alpha=4, targets=("q_proj",), seed=1, **extra)
    with pytest.raises(ValueError, match=words):
        load_adapter(tmp_path / "a", TINY, 4)
    # The same adapter without the setting reads.
    write_adapter(tmp_path / "b", TINY, rank=2, alpha=4, targets=("q_proj",), seed=1,
                  init_lora_weights=True)
    assert load_adapter(tmp_path / "b", TINY, 4).weights


def test_an_adapter_the_core_cannot_read_again_ends_its_request_with_the_reason(tmp_path):
    """The frontend's check passed an adapter it keeps unread, the core (which dropped it)
    reads its directory again and finds it gone: the request ends "error" naming why, and a
    failure that is not a refusal still ends it, "abort"."""
    import queue
    from types import SimpleNamespace

    from jaxllm.engine.core_proc import EngineCoreProc

    slots = LoRASlots(TINY, max_loras=1, max_lora_rank=RANK, dtype=jnp.float32)
    gone = LoRARequest("gone", 9, str(tmp_path / "deleted"))
    proc = object.__new__(EngineCoreProc)
    proc.engine_core = SimpleNamespace(add_request=lambda req: slots.register(req.lora_request))
    proc.output_queue = queue.Queue()
    req = EngineCoreRequest(request_id="r", prompt_token_ids=[1, 2], sampling_params=_params(),
                            eos_token_ids=[0], max_tokens=4, lora_request=gone)
    proc._add_request(req)
    _, outs = proc.output_queue.get_nowait()
    (out,) = outs.outputs
    assert out.request_id == "r" and out.finish_reason == "error"
    assert "deleted" in str(out.stop_reason)

    def broken(req):
        raise RuntimeError("a bug")

    proc.engine_core = SimpleNamespace(add_request=broken)
    proc._add_request(req)
    _, outs = proc.output_queue.get_nowait()
    assert outs.outputs[0].finish_reason == "abort"
