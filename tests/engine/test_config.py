"""EngineArgs -> EngineConfig: per-platform resolution in one place, model names, the engine-args
doc and CLI generated from the fields, and a frontend that imports no JAX."""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jaxllm.config import (
    GGUF_LAYOUTS,
    KERNEL_BACKENDS,
    MP_ENV_VAR,
    DraftModelConfig,
    EngineConfig,
    LaunchConfig,
    ParallelConfig,
    SpeculativeConfig,
    UsageContext,
    resolve_model,
)
from jaxllm.engine.arg_utils import EngineArgs, engine_args_markdown
from jaxllm.model_executor.layers.quantization import cpu_dequant_matmul
from tests.gguf_models import write_tiny_gguf

ROOT = Path(__file__).resolve().parents[2]


def test_per_platform_defaults_resolve_in_one_config():
    from jaxllm.model_executor.model_loader.tiny_model import tiny_qwen2_path

    path = str(tiny_qwen2_path())
    cpu = EngineArgs(model=path).create_engine_config("cpu")
    assert (cpu.model, cpu.model_path) == (path, path)
    assert (cpu.dtype, cpu.kv_cache_dtype, cpu.activation_dtype) == ("float32",) * 3
    assert (cpu.kernel_backend, cpu.quantization, cpu.gemv_max_rows) == ("reference", "none", 0)
    assert not cpu.topk_sampling and cpu.async_scheduling
    assert cpu.platform == "cpu"
    assert cpu.lora_skip_unused_slots

    gpu = EngineArgs(model=path).create_engine_config("gpu")
    assert (gpu.dtype, gpu.kv_cache_dtype, gpu.activation_dtype) == ("bfloat16",) * 3
    assert (gpu.kernel_backend, gpu.gemv_max_rows) == ("pallas", 0)
    assert gpu.topk_sampling and not gpu.lora_skip_unused_slots

    # bfloat16 on CPU: float32 KV and hidden states, GEMV buckets (under 16 rows) on f32 copies.
    bf16 = EngineArgs(model=path, dtype="bfloat16", tensor_parallel_size=2,
                      topk_sampling=True, async_scheduling=False).create_engine_config("cpu")
    assert (bf16.dtype, bf16.kv_cache_dtype, bf16.activation_dtype) == \
        ("bfloat16", "float32", "float32")
    assert bf16.gemv_max_rows == 15 and bf16.topk_sampling and not bf16.async_scheduling
    # Interpret-mode Pallas keeps the weights' dtype for activations.
    interp = EngineArgs(model=path, dtype="bfloat16", kernel_backend="interpret")
    assert interp.create_engine_config("cpu").activation_dtype == "bfloat16"
    given = EngineArgs(model=path, kv_cache_memory_bytes=1 << 20, num_kv_blocks=9)
    assert (given.create_engine_config("gpu").kv_cache_memory_bytes,
            given.create_engine_config("gpu").num_kv_blocks) == (1 << 20, 9)

    with pytest.raises(dataclasses.FrozenInstanceError):
        cpu.dtype = "bfloat16"  # type: ignore[misc]

    # The Pallas GEMV for small buckets: off unless asked, on a Pallas backend only.
    assert cpu.pallas_gemv_max_rows == gpu.pallas_gemv_max_rows == 0
    assert EngineArgs(model=path, pallas_gemv_max_rows=8).create_engine_config(
        "gpu").pallas_gemv_max_rows == 8
    with pytest.raises(ValueError, match="pallas_gemv_max_rows=8 needs a Pallas kernel "
                                         "backend"):
        EngineArgs(model=path, pallas_gemv_max_rows=8).create_engine_config("cpu")
    for bad in (17, False, 0.0):
        with pytest.raises(ValueError, match=f"from 0 to 16, got {bad}"):
            EngineArgs(model=path, pallas_gemv_max_rows=bad).create_engine_config("gpu")


def test_model_names_resolve_in_one_function(tmp_path):
    from jaxllm.model_executor.model_loader.default_model import default_model_path
    from jaxllm.model_executor.model_loader.tiny_model import tiny_qwen2_path

    assert resolve_model(None) == default_model_path()
    assert resolve_model("tiny-qwen2") == tiny_qwen2_path()
    assert resolve_model(str(tmp_path)) == tmp_path
    assert resolve_model("~/x.gguf") == Path.home() / "x.gguf"
    assert (tiny_qwen2_path() / "config.json").is_file()


def test_llm_runs_the_tiny_model_by_name():
    """LLM(model="tiny-qwen2") loads the tiny checkpoint; its greedy tokens are the argmax of
    Hugging Face's logits on the same checkpoint, with the same logprobs."""
    torch = pytest.importorskip("torch", reason="torch (the Hugging Face oracle) is not installed")
    import transformers

    from jaxllm import LLM, SamplingParams
    from jaxllm.model_executor.model_loader.tiny_model import tiny_qwen2_path

    llm = LLM(model="tiny-qwen2", max_model_len=64, max_num_seqs=2, max_num_batched_tokens=32,
              num_kv_blocks=16, show_progress=False, dtype="float32")
    config = llm.llm_engine.engine_config
    assert (config.model, config.model_path) == ("tiny-qwen2", str(tiny_qwen2_path()))
    assert llm.llm_engine.model_config.num_hidden_layers == 2
    out = llm.generate("def add(a, b):", SamplingParams(temperature=0, max_tokens=4,
                                                        logprobs=0, ignore_eos=True),
                       use_tqdm=False)[0]
    llm.shutdown()
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_qwen2_path())).eval()
    tokens = out.prompt_token_ids + out.outputs[0].token_ids
    with torch.no_grad():
        logits = hf(torch.tensor([tokens])).logits[0].double()
    logprobs = torch.log_softmax(logits, -1).numpy()
    n = len(out.prompt_token_ids)
    for i, (tok, lp) in enumerate(zip(out.outputs[0].token_ids, out.outputs[0].logprobs,
                                      strict=True)):
        row = logprobs[n - 1 + i]
        assert row[tok] >= row.max() - 1e-4  # the argmax, up to float ties
        assert np.isclose(lp[tok].logprob, row[tok], atol=1e-3)


def test_kernel_backends_named_without_jax_match_the_kernels():
    import pallas_kernels

    assert KERNEL_BACKENDS == pallas_kernels.BACKENDS


def test_engine_args_doc_is_generated_from_the_fields():
    assert (ROOT / "docs" / "engine_args.md").read_text() == engine_args_markdown(), \
        "docs/engine_args.md is stale: run `python scripts/generate_engine_args_doc.py`"
    for f in dataclasses.fields(EngineArgs):
        assert f.metadata["help"] and f"| `{f.name}` |" in engine_args_markdown()
    # Every resolved setting has its argument (the config adds the model path, dtypes derived
    # from dtype, the GEMV rows, the GGUF layout, the platform, the launch config, whose
    # settings but the frontend's kind have their arguments too, the hybrid KV cache from
    # disable_hybrid_kv_cache_manager and the speculative config, and LoRA's skipping of
    # unused slots from the platform).
    derived = {"model_path", "kv_cache_dtype", "activation_dtype", "gemv_max_rows",
               "gguf_layout", "attention_impl", "platform", "launch_config", "hybrid_kv_cache",
               "lora_skip_unused_slots"}
    args = {f.name for f in dataclasses.fields(EngineArgs)}
    assert {f.name for f in dataclasses.fields(EngineConfig)} - derived <= args
    launch = {f.name for f in dataclasses.fields(LaunchConfig)
              + dataclasses.fields(ParallelConfig)}
    assert launch - {"usage_context", "parallel_config"} <= args


def test_cli_flags_and_help_come_from_the_fields():
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    actions = {a.dest: a for a in parser._actions}
    for f in dataclasses.fields(EngineArgs):
        assert actions[f.name].help.startswith(f.metadata["help"]) or \
            actions[f.name].help.startswith("turn off: " + f.metadata["help"]), f.name
    args = EngineArgs.from_cli_args(parser.parse_args(
        ["--model", "tiny-qwen2", "--no-enable-prefix-caching", "--topk-sampling",
         "--max-num-seqs", "3"]))
    assert args == EngineArgs(model="tiny-qwen2", enable_prefix_caching=False,
                              topk_sampling=True, max_num_seqs=3)


# jaxllm.lora.adapter: the Processor reads a request's LoRA adapter in the frontend.
FRONTEND_MODULES = ("jaxllm", "jaxllm.engine.arg_utils", "jaxllm.engine.llm_engine",
                    "jaxllm.engine.async_llm", "jaxllm.engine.mp_client",
                    "jaxllm.entrypoints.openai.api_server", "jaxllm.entrypoints.cli.main",
                    "jaxllm.lora.adapter")


def test_frontend_imports_no_jax():
    """A multiprocess frontend never starts JAX (the core's process does): importing it loads
    no JAX module at all."""
    code = (f"import sys, {', '.join(FRONTEND_MODULES)}\n"
            "bad = sorted(m for m in sys.modules if m == 'jax' or m.startswith('jax.'))\n"
            "assert not bad, bad[:5]\n"
            "import jaxllm.engine.core\n"
            "assert 'jax' in sys.modules\n")  # the check itself can see JAX
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]


def test_launch_config_is_decided_once_and_carried(monkeypatch):
    """What the frontend decides before JAX starts (multiprocess mode per frontend, CUDA graphs'
    flags, ParallelConfig) is one LaunchConfig, which the EngineConfig carries as it was given."""
    from jaxllm.model_executor.model_loader.tiny_model import tiny_qwen2_path

    path = str(tiny_qwen2_path())
    monkeypatch.delenv(MP_ENV_VAR, raising=False)
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    for name in ("JAXLLM_COORDINATOR_ADDRESS", "JAXLLM_NUM_PROCESSES", "JAXLLM_PROCESS_ID"):
        monkeypatch.delenv(name, raising=False)
    args = EngineArgs(model=path, tensor_parallel_size=2, cuda_graph_triton=True)
    # On CPU: LLM keeps the core in its process, AsyncLLM (an event loop) runs it in its own.
    llm = args.create_launch_config(UsageContext.LLM_CLASS)
    async_llm = args.create_launch_config(UsageContext.ASYNC_LLM)
    assert not llm.multiprocess_mode and async_llm.multiprocess_mode
    assert EngineArgs(multiprocess_mode=True).create_launch_config().multiprocess_mode
    assert llm.cuda_graph_triton and not EngineArgs().create_launch_config().cuda_graph_triton
    assert llm.parallel_config == ParallelConfig(tensor_parallel_size=2)
    assert not llm.parallel_config.multihost

    config = args.create_engine_config("cpu", launch_config=async_llm)
    assert config.launch_config is async_llm
    assert config.parallel_config is async_llm.parallel_config
    assert config.tensor_parallel_size == 2
    # Built alone: resolved for LLM.
    assert args.create_engine_config("cpu").launch_config == llm

    # Several hosts: the arguments, else the environment.
    given = EngineArgs(model=path, coordinator_address="10.0.0.1:1234", num_processes=2,
                       process_id=1)
    assert given.create_engine_config("cpu").parallel_config == ParallelConfig(
        tensor_parallel_size=1, coordinator_address="10.0.0.1:1234", num_processes=2,
        process_id=1)
    monkeypatch.setenv("JAXLLM_COORDINATOR_ADDRESS", "10.0.0.2:99")
    monkeypatch.setenv("JAXLLM_NUM_PROCESSES", "4")
    monkeypatch.setenv("JAXLLM_PROCESS_ID", "3")
    parallel = EngineArgs().create_launch_config().parallel_config
    assert (parallel.coordinator_address, parallel.num_processes, parallel.process_id,
            parallel.multihost) == ("10.0.0.2:99", 4, 3, True)
    monkeypatch.setenv("JAXLLM_PROCESS_ID", "4")
    with pytest.raises(ValueError, match=r"process_id 4 is not in \[0, num_processes 4\)"):
        EngineArgs().create_launch_config()
    monkeypatch.delenv("JAXLLM_NUM_PROCESSES")
    with pytest.raises(ValueError, match="JAXLLM_NUM_PROCESSES"):
        EngineArgs().create_launch_config()


def test_gguf_layout_and_draft_model_config_resolve_in_the_config(tmp_path):
    """The loader's GGUF layout and the draft model's settings are fields of the config."""
    from jaxllm.model_executor.model_loader.tiny_model import tiny_qwen2_path

    path = str(tiny_qwen2_path())
    gguf = tmp_path / "tiny.gguf"
    write_tiny_gguf(gguf)
    kernel = cpu_dequant_matmul.available()

    def layout(model, platform="cpu", **kw):
        return EngineArgs(model=str(model), **kw).create_engine_config(platform).gguf_layout

    assert layout(path) == "none"
    assert layout(gguf) == ("panels" if kernel else "none")  # not kept quantized without it
    assert layout(gguf, quantization="gguf") == ("panels" if kernel else "rows")
    assert layout(gguf, quantization="gguf", kernel_backend="interpret") == "rows"
    assert layout(gguf, platform="gpu", quantization="gguf", dtype="float32") == "rows"
    if kernel:
        assert layout(gguf, gguf_compact=True) == "compact"
    assert {layout(gguf), layout(gguf, quantization="gguf")} <= set(GGUF_LAYOUTS)

    def spec(model):
        return {"method": "draft_model", "model": str(model), "num_speculative_tokens": 2}

    config = EngineArgs(model=path, speculative_config=spec(path)).create_engine_config("cpu")
    assert config.speculative_config is not None
    assert config.speculative_config.draft_model_config == DraftModelConfig(
        model_path=path, dtype="float32", kernel_backend="reference", quantization="none",
        gguf_layout="none", gemv_max_rows=0)
    bf16 = EngineArgs(model=path, dtype="bfloat16", speculative_config=spec(gguf)) \
        .create_engine_config("cpu").speculative_config
    assert bf16 is not None and bf16.draft_model_config == DraftModelConfig(
        model_path=str(gguf), dtype="bfloat16", kernel_backend="reference", quantization="none",
        gguf_layout="none", gemv_max_rows=15)  # bfloat16 on CPU: float32 GEMV copies
    if kernel:
        draft = EngineArgs(model=str(gguf), speculative_config=spec(gguf), gguf_compact=True) \
            .create_engine_config("cpu").speculative_config
        assert draft is not None and draft.draft_model_config is not None
        assert (draft.draft_model_config.quantization, draft.draft_model_config.gguf_layout) \
            == ("gguf", "compact")
    # Resolved, never an argument.
    with pytest.raises(ValueError, match="unknown key"):
        SpeculativeConfig.from_dict({**spec(path), "draft_model_config": None})
    assert EngineArgs(speculative_config=spec(path)).speculative_config == \
        {"method": "draft_model", "num_speculative_tokens": 2, "prompt_lookup_min": 2,
         "prompt_lookup_max": 5, "model": path, "revision": None}


def test_config_changes_no_environment():
    """Importing the config and resolving an engine's settings (CUDA graphs asked for) leave
    the environment as it was: the process that starts JAX applies platform_env itself."""
    code = ("import os\n"
            "before = dict(os.environ)\n"
            "import jaxllm.config\n"
            "from jaxllm.engine.arg_utils import EngineArgs\n"
            "from jaxllm.model_executor.model_loader.tiny_model import tiny_qwen2_path\n"
            "args = EngineArgs(model=str(tiny_qwen2_path()), cuda_graph_triton=True)\n"
            "launch = args.create_launch_config()\n"
            "assert jaxllm.config.platform_env(launch, os.environ)\n"
            "args.create_engine_config('cpu', launch)\n"
            "assert dict(os.environ) == before, set(os.environ.items()) ^ set(before.items())\n")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=300, env=env)
    assert res.returncode == 0, res.stderr[-2000:]
