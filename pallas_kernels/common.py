"""What the kernel modules share: backend names, power-of-two sizes, a whole-array BlockSpec,
and lowering for CUDA with no GPU present on every supported JAX."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.sharding import AbstractDevice, AbstractMesh, Mesh, use_abstract_mesh

# From JAX 0.11, Pallas' Triton backend warns at every lowering (deprecation id
# "jax-pallas-triton"), yet through 0.12 it is still what pallas_call uses on CUDA, and these
# kernels are written for it (masked plgpu.load/store, power-of-two blocks). The migration is
# Mosaic GPU (jax.experimental.pallas.mosaic_gpu: explicit shared-memory staging with TMA
# copies and warpgroup matmuls), a rewrite of every kernel; until then the warning tells a
# user nothing to act on. tests/conftest.py hands the same filter to pytest, which resets
# warning filters for each test.
_TRITON_DEPRECATION = "The Pallas Triton backend is deprecated"
TRITON_DEPRECATION_FILTER = f"ignore:{_TRITON_DEPRECATION}:DeprecationWarning"
warnings.filterwarnings("ignore", message=_TRITON_DEPRECATION, category=DeprecationWarning)

# The GPU a lowering targets when none is present. JAX 0.10 falls back to compute capability
# 9.0 by itself; from 0.11 the target is the abstract mesh's device, and lowering fails without
# one. An H100 (sm_90) is the same target on both.
LOWERING_DEVICE = AbstractDevice(device_kind="NVIDIA H100", num_cores=132, platform="gpu")

BACKENDS: tuple[str, ...] = ("pallas", "interpret", "reference")


def check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")


def next_pow2(n: int) -> int:
    """Triton block shapes must be powers of two: the smallest one >= n, for n >= 1."""
    return 1 << max(0, (int(n) - 1).bit_length())


def prev_pow2(n: int) -> int:
    """Largest power of two <= n, for n >= 1; 1 for n = 0."""
    return 1 << max(0, int(n).bit_length() - 1)


def check_layer(layer: int | jax.Array, num_layers: int) -> int | jax.Array:
    """The layer index of a kernel call: a Python int (checked against ``num_layers``) or a
    scalar integer array. A traced value cannot be checked: out of range, the results are
    undefined (the GPU kernels would address memory past the KV array)."""
    if isinstance(layer, (int, np.integer)):
        if not 0 <= layer < num_layers:
            raise ValueError(f"layer {layer} out of range for a KV array of {num_layers} layers")
        return int(layer)
    layer = jnp.asarray(layer)
    if layer.size != 1 or not jnp.issubdtype(layer.dtype, jnp.integer):
        raise ValueError(f"layer must be an int or a one-element integer array, got "
                         f"{layer.dtype}{list(layer.shape)}")
    return layer.reshape(())


def layer_operand(layer: int | jax.Array, num_layers: int) -> jax.Array:
    """The layer as the [1] int32 operand the kernels read it from. As an operand, not a
    constant of the kernel, it leaves the Triton module the same for every layer: XLA compiles
    one module per kernel and bucket, not one per layer."""
    return jnp.asarray(check_layer(layer, num_layers), jnp.int32).reshape(1)


def whole_block_spec(shape: Sequence[int]) -> pl.BlockSpec:
    """A BlockSpec whose block is the whole array, the same for every program of any grid.

    The kernels address such refs themselves (gathered indices, masked loads), because Triton
    only takes power-of-two blocks and the arrays (hidden 896, 14 heads, ...) often are not.
    """
    zeros = (0,) * len(shape)
    return pl.BlockSpec(tuple(shape), lambda *grid_indices: zeros)


def lower_for_cuda(fn: Callable, args: Sequence, mesh: Mesh | AbstractMesh | None = None,
                   donate_argnums: int | Sequence[int] = ()) -> jax.stages.Lowered:
    """Lower `jax.jit(fn, donate_argnums=...)(*args)` for CUDA on a host without a GPU (abstract
    arguments such as `jax.ShapeDtypeStruct` are fine). `mesh`: the mesh the arguments are
    sharded over; a `shard_map` inside `fn` needs its own mesh from `abstract_cuda_mesh`."""
    abstract = AbstractMesh((), ()) if mesh is None else mesh.abstract_mesh
    with use_abstract_mesh(abstract.update(abstract_device=LOWERING_DEVICE)):
        jitted = jax.jit(fn, donate_argnums=donate_argnums)
        return jitted.trace(*args).lower(lowering_platforms=("cuda",))


def abstract_cuda_mesh(axis_sizes: tuple[int, ...], axis_names: tuple[str, ...]) -> AbstractMesh:
    """A device-free mesh naming the GPU that `lower_for_cuda` lowers for: the mesh of a
    `shard_map` traced without devices (JAX 0.11 lowers its body for the mesh's device)."""
    return AbstractMesh(axis_sizes, axis_names, abstract_device=LOWERING_DEVICE)
