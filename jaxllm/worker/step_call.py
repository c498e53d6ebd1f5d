"""One compiled step called through its loaded executable, with its weights flattened once.

`Compiled.__call__` checks every argument's type, shape, sharding and placement on each call in
C++ (about half a microsecond each; a step has a weight tree of a few hundred arrays) and moves
numpy inputs through the general transfer path. A step's weights never change between calls,
so `StepCall` flattens them once and each call hands the executable one flat list: the weights,
the KV array and logits buffer (both donated), and the step's inputs packed into one int32
vector, put on the device by jaxlib's batched transfer. `benchmarks/dispatch.py` measures both
paths. Used for single-device steps; a mesh keeps `Compiled.__call__`, which assembles sharded
outputs.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.core import ShapedArray
from jaxlib import xla_client

_PACKED_DTYPE = np.dtype(np.int32)


class StepCall:
    """`compiled(weights..., kv_cache, logits_buf, packed)` with the weights bound: call it as
    `step(kv_cache, logits_buf, packed)` for the step's output tree (kv_cache and logits_buf
    are donated, as with the compiled call)."""

    def __init__(self, compiled: Any, weights: Any) -> None:
        self.executable = compiled.runtime_executable()
        self.out_tree = compiled.out_tree
        self.weights = jax.tree.leaves(weights)
        num_args = len(self.weights) + 3
        if len(jax.tree.leaves(compiled.input_shardings[0])) != num_args:
            raise ValueError(f"the compiled step takes "
                             f"{len(jax.tree.leaves(compiled.input_shardings[0]))} arrays; "
                             f"weights + KV + logits buffer + inputs make {num_args}")
        num_outputs = len(jax.tree.leaves(compiled.output_shardings))
        if num_outputs != self.out_tree.num_leaves:  # e.g. an output JAX forwards from an input
            raise ValueError(f"the step's executable returns {num_outputs} arrays; its output "
                             f"tree has {self.out_tree.num_leaves}")
        self.sharding = jax.tree.leaves(compiled.input_shardings[0])[-1]
        self.devices = list(self.sharding.addressable_devices)
        if len(self.devices) != 1:
            raise ValueError("StepCall runs single-device steps; a mesh uses the compiled call")
        self._avals: dict[int, Any] = {}

    def rebind(self, weights: Any) -> None:
        """Bind new weight arrays of the same tree and shapes (LoRA slots after a load)."""
        leaves = jax.tree.leaves(weights)
        if len(leaves) != len(self.weights):
            raise ValueError(f"rebind got {len(leaves)} arrays; the step takes "
                             f"{len(self.weights)}")
        self.weights = leaves

    @staticmethod
    def supported(compiled: Any) -> bool:
        """Whether this JAX exposes what `StepCall` uses (else callers use `compiled`)."""
        return (hasattr(xla_client, "batched_device_put")
                and hasattr(compiled, "runtime_executable")
                and hasattr(compiled.runtime_executable(), "execute_sharded"))

    def _aval(self, size: int) -> Any:
        aval = self._avals.get(size)
        if aval is None:
            aval = self._avals[size] = ShapedArray((size,), _PACKED_DTYPE)
        return aval

    def __call__(self, kv_cache: jax.Array, logits_buf: jax.Array, packed: np.ndarray) -> Any:
        inputs = xla_client.batched_device_put(self._aval(packed.shape[0]), self.sharding,
                                               [packed], self.devices, True)
        return self.execute(kv_cache, logits_buf, inputs)

    def execute(self, kv_cache: jax.Array, logits_buf: jax.Array, inputs: jax.Array) -> Any:
        """The call with the packed inputs already on the device."""
        results = self.executable.execute_sharded([*self.weights, kv_cache, logits_buf, inputs])
        outs = [shards[0] for shards in results.disassemble_into_single_device_arrays()]
        return jax.tree.unflatten(self.out_tree, outs)
