"""How a step is called: inputs packed into one vector, the compiled step called through its
executable with the weights bound (StepCall), and the kernels a decode step launches per
layer (benchmarks/step_ops.py)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from benchmarks.step_ops import count_step_ops, summarize
from jaxllm import SamplingParams
from jaxllm.model_executor.config import ModelConfig
from jaxllm.worker.input_batch import DeviceInputs
from jaxllm.worker.lowering import lower_step_for_cuda
from tests.utils import make_llm, runner_of


@pytest.fixture(scope="module")
def llm(tiny):
    # No prefix caching: every run computes the same steps, so their results compare exactly.
    return make_llm(tiny[0], max_num_seqs=4, multiprocess_mode=False,
                    enable_prefix_caching=False)


def _run(llm, prompts):
    params = [SamplingParams(temperature=0, max_tokens=12, logprobs=3),
              SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=12, logprobs=3)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts for _ in params],
                        params * len(prompts), use_tqdm=False)
    return [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in d.items()}
                                      for d in o.outputs[0].logprobs]) for o in outs]


def test_packed_inputs_round_trip():
    shapes = DeviceInputs.shapes(8, 3, 5, 4)
    rng = np.random.default_rng(0)
    fields = {name: rng.integers(-5, 1000, s).astype(np.int32) for name, s in shapes.items()}
    packed = DeviceInputs(**fields).pack()
    assert packed.shape == (DeviceInputs.packed_size(shapes),) and packed.dtype == np.int32
    back = DeviceInputs.unpack(packed, shapes)
    for name, value in fields.items():
        np.testing.assert_array_equal(back[name], value)
    with pytest.raises(ValueError, match=r"packed step inputs hold \(10,\) values"):
        DeviceInputs.unpack(packed[:10], shapes)


def test_step_call_gives_the_compiled_calls_results(llm, prompts):
    # jit's C++ fast path counts its Python fallbacks in a test utility of JAX's own.
    jtu = pytest.importorskip("jax._src.test_util")
    if not hasattr(jtu, "count_aot_jit_cpp_cache_miss"):
        pytest.skip("this JAX does not count its compiled calls' Python fallbacks")
    runner = runner_of(llm)
    assert runner.uses_fast_dispatch()
    fast = _run(llm, prompts[:3])
    runner.set_fast_dispatch(False)
    try:
        assert not runner.uses_fast_dispatch()
        # The general path, once every shape has been called with each argument signature
        # (the KV array and logits buffers the other path left are committed to the device,
        # its own outputs are not), stays on jit's C++ fast path: no step goes through
        # Python's Compiled.call again.
        _run(llm, prompts[:3])
        _run(llm, prompts[:3])
        with jtu.count_aot_jit_cpp_cache_miss() as python_calls:
            slow = _run(llm, prompts[:3])
        assert python_calls() == 0
    finally:
        runner.set_fast_dispatch(True)
    assert fast == slow  # tokens and logprobs, bit for bit
    assert _run(llm, prompts[:3]) == fast


def test_decode_step_kernels_per_layer(llm):
    runner = runner_of(llm)
    config: ModelConfig = runner.config
    # The lowered CUDA step: per layer one QKV, one O, one gate-up and one down matmul, and the
    # Pallas kernels (two RMSNorms, the QKV epilogue with RoPE and the KV write, attention and
    # its split-K combine at most).
    lowered = lower_step_for_cuda(config, 1, True, max_model_len=256)
    cuda = summarize(count_step_ops(lowered.compiler_ir("hlo").as_hlo_text()))
    assert cuda["num_layers"] == config.num_hidden_layers and not cuda["layers_differing"]
    assert cuda["per_layer"]["dot"] == 4
    assert 4 <= cuda["per_layer"]["custom-call:__gpu$xla.gpu.triton"] <= 5
    assert cuda["outside"]["dot"] == 1  # the LM head
    # The CPU executable the runner runs: the same four matmuls per layer.
    cpu = summarize(count_step_ops(runner.get_compiled_hlo(1, 1)))
    assert cpu["num_layers"] == config.num_hidden_layers
    layer_dots = [c.get("dot", 0) for c in [cpu["per_layer"], *cpu["layers_differing"].values()]]
    assert set(layer_dots) == {4}, cpu
    if jax.default_backend() == "cpu" and "custom-call" in cpu["per_layer"]:
        assert cpu["per_layer"]["custom-call:jaxllm_paged_attention"] == 1
