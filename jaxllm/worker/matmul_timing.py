"""A step's weight matmuls alone, timed on the weights the worker holds: the benchmarks'
matmul floor (jaxllm/benchmarks/matmul_floor.py) prices a run's step shapes with it through
`ModelRunner.time_weight_matmuls` (the engine core's collective_rpc), since only the runner
has the weights."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.model_executor.config import ModelConfig
from jaxllm.model_executor.layers.linear import linear
from jaxllm.model_executor.layers.logits import compute_logits
from jaxllm.model_executor.layers.quantization.gguf import GGUFWeight
from jaxllm.worker.buckets import MIN_TOKEN_BUCKET


def best_seconds(fn: Callable[[], Any], reps: int) -> float:
    """Fastest of `reps` timed calls of `fn` after one untimed warm-up call."""
    fn()
    best = math.inf
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def decoder_matmuls(params: dict, config: ModelConfig, x: jax.Array,
                    backend: str = "reference", gemv_rows: int = 0) -> jax.Array:
    """The decoder layers with everything but their weight matmuls removed: per layer qkv, o,
    gate_up and down, with the SiLU gate and residual adds that chain them as in the model.
    `params` needs only `layers_{i}` in the model's naming; `config` only the sizes used."""
    if config.moe is not None:
        raise ValueError(f"{config.architecture}: the weight-matmul floor models dense MLPs only, "
                         f"not a mixture of experts")
    q_width = config.num_attention_heads * config.head_dim
    inter = config.intermediate_size
    for i in range(config.num_hidden_layers):
        attn, mlp = params[f"layers_{i}"]["self_attn"], params[f"layers_{i}"]["mlp"]
        qkv = linear(x, attn["qkv_proj"]["weight"], backend, gemv_rows)
        x = x + linear(qkv[:, :q_width], attn["o_proj"]["weight"], backend, gemv_rows)
        gate_up = linear(x, mlp["gate_up_proj"]["weight"], backend, gemv_rows)
        x = x + linear(jax.nn.silu(gate_up[:, :inter]) * gate_up[:, inter:],
                       mlp["down_proj"]["weight"], backend, gemv_rows)
    return x


def weight_matmuls(params: dict, config: ModelConfig, x: jax.Array,
                   logits_rows: int, backend: str = "reference", gemv_rows: int = 0
                   ) -> jax.Array:
    """`decoder_matmuls`, then the LM head on the first `logits_rows` rows, as the engine's
    step runs it: the model's forward pass with nothing but its weight matmuls."""
    hidden = decoder_matmuls(params, config, x, backend, gemv_rows)[:logits_rows]
    return compute_logits(params, config, hidden, backend, gemv_rows)


def time_weight_matmuls(params: dict, config: ModelConfig, dtype: Any, max_num_seqs: int,
                        num_tokens: list[int], reps: int,
                        backend: str = "reference", gemv_rows: int = 0,
                        repeats: int = 1) -> dict[int, float]:
    """Best-of-`reps` seconds of one jitted `weight_matmuls` step at each token count (its
    logits rows min(num_tokens, max_num_seqs), as the engine's step computes them), on
    activations of `dtype`. Pure: the caller passes the weights and sizes. `repeats` > 1 runs
    the step that many times, chained, in one program and returns the time of one: the call's
    own cost (a GPU's launch of a few hundred arguments is comparable to the matmuls) is then
    spread over them."""
    out: dict[int, float] = {}
    for n in num_tokens:
        if n in out:
            continue
        rows = min(n, max_num_seqs)

        def chained(p: dict, x: jax.Array, _rows: int = rows) -> jax.Array:
            for _ in range(repeats - 1):
                logits = weight_matmuls(p, config, x, _rows, backend, gemv_rows)
                # Each repeat depends on the last, so none is computed once for all.
                x = x + (0 * logits.max()).astype(x.dtype)
            return weight_matmuls(p, config, x, _rows, backend, gemv_rows)

        fn = jax.jit(chained)
        x = jnp.full((n, config.hidden_size), 0.01, dtype)
        out[n] = best_seconds(lambda _fn=fn, _x=x: _fn(params, _x).block_until_ready(),
                              reps) / repeats
    return out


def weight_stats(runner: Any) -> dict[str, int]:
    """body_params (decoder layers + final norm), head_params (LM head), itemsize, and
    decode_weight_bytes (the weights a 1-row decode step reads, in their stored formats)."""
    params, cfg = runner.params, runner.config
    body = sum(math.prod(x.shape) for k, v in params.items()  # a GGUFWeight: its values
               if k not in ("embed_tokens", "lm_head")
               for x in jax.tree.leaves(v, is_leaf=lambda x: isinstance(x, GGUFWeight)))
    # What a 1-row decode step reads: its own tree (quantized, or float32 GEMV copies).
    step = runner.params_for(1, 1)
    step_bytes = sum(int(x.nbytes) for k, v in step.items()
                     if k != "embed_tokens" or cfg.tie_word_embeddings
                     for x in jax.tree.leaves(v))
    return {"body_params": body, "head_params": cfg.vocab_size * cfg.hidden_size,
            "itemsize": int(np.dtype(params["norm"]["weight"].dtype).itemsize),
            "decode_weight_bytes": step_bytes}


def time_runner_matmuls(runner: Any, num_tokens: list[int], reps: int = 3) -> dict[int, float]:
    """`time_weight_matmuls` at each token count with that bucket's weights (fewer rows than
    MIN_TOKEN_BUCKET: a decode bucket's), the runner's kernel backend and its steps' matmul
    precision."""
    out: dict[int, float] = {}
    for n in num_tokens:
        tree = runner.params_for(n, 1 if n < MIN_TOKEN_BUCKET else n)
        with jax.default_matmul_precision(runner.matmul_precision):
            out.update(time_weight_matmuls(tree, runner.config, runner.activation_dtype,
                                           runner.max_num_seqs,
                                           [n], reps, runner.model.kernel_backend,
                                           runner.model.gemv_kernel_rows))
    return out
