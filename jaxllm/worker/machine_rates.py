"""The machine's rates the roofline (jaxllm/benchmarks/roofline.py) bounds a run by: a GEMM's
FLOP/s and the memory bandwidth, measured in the process that holds the device
(`ModelRunner.measure_machine`, through the engine core's collective_rpc)."""

from __future__ import annotations

import numpy as np

from jaxllm.worker.matmul_timing import best_seconds


def measure_gemm(n: int = 2048, reps: int = 3, dtype: str = "float32") -> dict[str, float]:
    """Best-of-`reps` rate of an n x n x n GEMM: XLA (jitted jnp.dot on the default device, in
    `dtype`) and numpy (float32, host)."""
    import jax
    import jax.numpy as jnp

    flops = 2.0 * n ** 3
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    dot = jax.jit(jnp.dot)
    xa, xb = jnp.asarray(a, dtype), jnp.asarray(b, dtype)
    best_xla = best_seconds(lambda: dot(xa, xb).block_until_ready(), reps)
    best_np = best_seconds(lambda: a @ b, reps)
    xla, numpy_rate = flops / best_xla, flops / best_np
    return {"gemm_size": n, "xla_flops_per_s": xla, "numpy_flops_per_s": numpy_rate,
            "gemm_flops_per_s": max(xla, numpy_rate)}


def measure_bandwidth(mib: int = 256, reps: int = 5) -> dict[str, float]:
    """Best-of-`reps` streaming bandwidth over `mib` MiB: numpy's copyto into a second array
    (host) and a jitted XLA scale of an array donated to it, so it runs in place (default
    device; a fresh output buffer each call would time page faults), both counting read + write
    bytes; and an XLA GEMV reading a `mib` MiB matrix (read bytes only). The bandwidth used for
    bounds is the best of the three."""
    import jax
    import jax.numpy as jnp

    from jaxllm.model_executor.layers.linear import linear

    n = max(1, mib * (1 << 20) // 4)
    moved = 2.0 * n * 4
    src = np.ones(n, np.float32)
    dst = np.empty_like(src)
    best_np = best_seconds(lambda d=dst, s=src: np.copyto(d, s), reps)
    del dst
    scale = jax.jit(lambda x: x * 0.5, donate_argnums=0)
    held = {"x": jnp.asarray(src)}  # each call donates the previous result
    del src

    def scale_in_place() -> None:
        held["x"] = scale(held["x"]).block_until_ready()

    best_xla = best_seconds(scale_in_place, reps)
    held.clear()
    # Decode streams weights without writing anything back: time that pattern too, as a GEMV
    # over a [rows, 1024] matrix kept [out, in] like the model's weights.
    w = jnp.ones((max(1, n // 1024), 1024), jnp.float32)
    vec = jnp.ones((1, 1024), jnp.float32)
    gemv = jax.jit(linear)
    best_gemv = best_seconds(lambda m=w: gemv(vec, m).block_until_ready(), reps)
    read_rate = w.size * 4 / best_gemv
    del w
    xla, numpy_rate = moved / best_xla, moved / best_np
    return {"copy_mib": mib, "xla_bytes_per_s": xla, "numpy_bytes_per_s": numpy_rate,
            "gemv_read_bytes_per_s": read_rate,
            "bandwidth_bytes_per_s": max(xla, numpy_rate, read_rate)}


def default_gemm_size(platform: str) -> int:
    """n of the timed GEMM: a GPU reaches its peak only on large tiles (a 2048^3 GEMM is a few
    hundred microseconds there, launch-bound); on CPU 2048 already does and 8192 takes minutes."""
    return 8192 if platform == "gpu" else 2048


def measure_machine(gemm_size: int | None = None, copy_mib: int = 256,
                    dtype: str = "float32") -> dict[str, float]:
    """GEMM rate and bandwidth of the default device and the host. Call it where the engine
    core runs (`ModelRunner.measure_machine`): on a GPU the core process holds the memory."""
    import jax

    if gemm_size is None:
        gemm_size = default_gemm_size(jax.default_backend())
    return {**measure_gemm(gemm_size, dtype=dtype), **measure_bandwidth(copy_mib)}
