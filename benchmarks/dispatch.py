"""What the host pays to call a step, apart from the step's own work.

    python benchmarks/dispatch.py [--shape qwen2.5-0.5b] [--calls 2000] [--output-json F]

A `ModelRunner` is built over zero weights at a real Qwen2 shape (nothing is loaded); then
executables with the decode step's exact arguments (the weight tree, RoPE tables, KV array,
logits buffer, step inputs) but a body that reads one input value are called back to back, so
their time is dispatch alone: argument handling, host-to-device transfers of the step inputs,
the executable's launch. Variants:

- `inputs_7_arrays`: the step inputs as seven numpy arrays, one per field (the general way:
  each transferred on its own inside the call);
- `inputs_packed`: the same values packed into one int32 vector (what the runner sends);
- `one_array`: a single weight array in place of the tree (the floor of argument handling);
- `step_call`: the packed call through `StepCall` (jaxllm/worker/step_call.py), the weights
  flattened once and the executable called directly: what the runner does on one device;
- `real_step` (with `--real-steps N`): the compiled decode step through `StepCall` (on a CPU
  this includes running the step, which starts inside the call);
- `real_step_fixed_input` (with `--real-steps N`): the same executable handed one device
  array for its inputs on every call, so no argument changes its address between calls: set
  against `real_step`, what a fresh input buffer per call costs (a GPU's command buffer is
  updated when an address it recorded changes);
- `real_step_launch`, `real_step_fixed_input_launch`: the same calls timed alone, each started
  on an idle device (what the host pays to start a step; the back-to-back times above are the
  larger of that and the device's time).

Per variant: microseconds per call (median of 5 rounds) and, for the tree variants, the extra
microseconds per argument against `one_array`. On a GPU the launch of the step's kernels comes
on top (see docs/gpu.md's trace part)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.gpu.realshape import DRY_RUN_SHAPE, shape_named  # noqa: E402
from jaxllm.model_executor.config import ModelConfig  # noqa: E402
from jaxllm.model_executor.models.qwen2 import Qwen2ForCausalLM  # noqa: E402
from jaxllm.model_executor.models.registry import abstract_params  # noqa: E402
from jaxllm.worker.input_batch import DeviceInputs  # noqa: E402
from jaxllm.worker.model_runner import ModelRunner  # noqa: E402
from jaxllm.worker.step_call import StepCall  # noqa: E402
from pallas_kernels.checks.shapes import QWEN2_SHAPES  # noqa: E402


def zero_runner(shape_name: str, dtype: str, max_num_seqs: int = 64,
                max_model_len: int = 1024, kernel_backend: str = "reference") -> ModelRunner:
    shape = shape_named(shape_name)
    config = ModelConfig.from_hf_config(shape.hf_config(max_position_embeddings=4096,
                                                        rope_theta=1e6, rms_norm_eps=1e-6))
    model = Qwen2ForCausalLM(config, dtype=jnp.dtype(dtype))
    params = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), abstract_params(model))
    runner = ModelRunner(config, params, dtype=jnp.dtype(dtype), kernel_backend=kernel_backend,
                         block_size=16, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                         max_num_batched_tokens=256)
    runner.initialize_kv_cache(64)
    return runner


def per_call_us(fn, calls: int, rounds: int = 5) -> float:
    """Median over `rounds` of the mean microseconds per call of `calls` calls in a row."""
    for _ in range(min(100, calls)):
        out = fn()
    jax.block_until_ready(out)
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            out = fn()
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(times)


def launch_us(fn, calls: int) -> float:
    """Median microseconds of the call alone, the device idle at each start (waited on after
    each call, outside the timing): the host's cost of starting the work, without the back
    pressure of a queue of calls in flight."""
    jax.block_until_ready(fn())
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        out = fn()
        times.append((time.perf_counter() - start) * 1e6)
        jax.block_until_ready(out)
    return statistics.median(times)


def measure(runner: ModelRunner, num_tokens: int, calls: int, real_steps: int
            ) -> dict[str, Any]:
    shape = (num_tokens, 1)
    shapes = runner.input_shapes(shape)
    fields = {name: np.zeros(s, np.int32) for name, s in shapes.items()}
    packed = DeviceInputs(**fields).pack()
    params = runner.params_for(*shape)
    rope, kv = runner.rope, runner.kv_cache
    buf = jnp.zeros((runner.step_sizes(shape)[1], runner.config.vocab_size), jnp.float32)
    num_leaves = len(jax.tree.leaves((params, rope)))

    def null(params, rope, kv, buf, *inputs):
        return inputs[0][0] + 1

    def compiled(*args):
        return jax.jit(null, keep_unused=True).lower(*args).compile()

    seven = compiled(params, rope, kv, buf, *fields.values())
    one = compiled(params, rope, kv, buf, packed)
    single = jnp.zeros(sum(x.size for x in jax.tree.leaves(params)) // 1024, jnp.float32)
    floor = jax.jit(lambda w, rope, kv, buf, x: x[0] + 1, keep_unused=True).lower(
        single, rope, kv, buf, packed).compile()
    bound = StepCall(one, (params, rope))

    results: dict[str, Any] = {
        "num_tokens": num_tokens, "arguments_tree": num_leaves + 3,
        "inputs_7_arrays_us": per_call_us(lambda: seven(params, rope, kv, buf,
                                                        *fields.values()), calls),
        "inputs_packed_us": per_call_us(lambda: one(params, rope, kv, buf, packed), calls),
        "one_array_us": per_call_us(lambda: floor(single, rope, kv, buf, packed), calls),
    }
    results["step_call_us"] = per_call_us(lambda: bound(kv, buf, packed), calls)
    results["per_argument_us"] = ((results["inputs_packed_us"] - results["one_array_us"])
                                  / num_leaves)
    if real_steps:
        # The compiled decode step itself, called as the runner calls it (on a CPU this
        # includes running the step).
        state = {"kv": runner.kv_cache}
        step = StepCall(runner.lower_step(num_tokens, 1, runner.num_kv_blocks).compile(),
                        (params, rope))

        def real() -> Any:
            *out, state["kv"] = step(state["kv"], buf_real.pop(), packed)
            buf_real.append(out[3])
            return out[3]

        buf_real = [jnp.zeros_like(buf)]
        results["real_step_us"] = per_call_us(real, real_steps, rounds=3)
        fixed = jax.device_put(packed, step.sharding)

        def real_fixed() -> Any:
            *out, state["kv"] = step.execute(state["kv"], buf_real.pop(), fixed)
            buf_real.append(out[3])
            return out[3]

        results["real_step_fixed_input_us"] = per_call_us(real_fixed, real_steps, rounds=3)
        results["real_step_launch_us"] = launch_us(real, real_steps)
        results["real_step_fixed_input_launch_us"] = launch_us(real_fixed, real_steps)
        runner.kv_cache = state["kv"]
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--shape", default="qwen2.5-0.5b",
                        choices=sorted([*QWEN2_SHAPES, DRY_RUN_SHAPE.name]))
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--num-tokens", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--real-steps", type=int, default=0,
                        help="also time N calls of the compiled decode step (0: not)")
    parser.add_argument("--kernel-backend", default="reference",
                        help="the real step's kernels (the null-body variants run none)")
    parser.add_argument("--output-json", default=None)
    ns = parser.parse_args(argv)
    runner = zero_runner(ns.shape, ns.dtype, kernel_backend=ns.kernel_backend)
    out = {"shape": ns.shape, "dtype": ns.dtype, "kernel_backend": ns.kernel_backend,
           "platform": jax.default_backend(), "xla_flags": os.environ.get("XLA_FLAGS", ""),
           "jax": jax.__version__, "device": str(jax.devices()[0].device_kind),
           "results": [measure(runner, t, ns.calls, ns.real_steps) for t in ns.num_tokens]}
    for r in out["results"]:
        print(f"decode bucket {r['num_tokens']:>3}: " + ", ".join(
            f"{k[:-3]} {v:.1f} us" for k, v in r.items()
            if k.endswith("_us") and k != "per_argument_us")
            + f"; {r['arguments_tree']} arguments, {r['per_argument_us']:.3f} us each")
    if ns.output_json:
        Path(ns.output_json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
