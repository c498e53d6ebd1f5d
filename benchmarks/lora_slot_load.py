"""How long loading a LoRA adapter into a device slot takes (the requests running meanwhile
wait for it).

    python benchmarks/lora_slot_load.py [--dtype float32 bfloat16] [--max-loras 4]
        [--rank 16] [--reps 5] [--output-json F]

`LoRASlots` is built for a model shape (default Llama-3-8B's: hidden 4096, 32 layers, q 4096,
kv 1024, intermediate 14336; no weights are needed) with synthetic adapters of rank `--rank`
on every projection, and adapters are loaded into slots in turn, each timed until the device
tree is ready:

- `slot_write`: what the engine does, `LoRASlots.activate`: that slot's arrays built on the
  host from the adapter kept in the slots' dtype, sent, and written into the device tree in
  place;
- `whole_tree_put`: for comparison, the slot filled from the float32 adapter in a float32
  host copy of every slot, and the whole tree cast and put on the device again.

Per dtype: the median and minimum seconds of `--reps` loads of each, the one-time compile of
the slot write, and the bytes each way sends to the device. On CPU, XLA computes a bfloat16
update in float32 (it has no bfloat16 dynamic-update-slice): the write stays in the tree's
buffers but passes over every slot, so there bfloat16 gains less; XLA's GPU backend moves
bfloat16 data natively.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxllm.lora.adapter import LoRAAdapter, module_dims  # noqa: E402
from jaxllm.lora.slots import LoRASlots  # noqa: E402
from jaxllm.model_executor.config import ModelConfig  # noqa: E402


def synthetic_adapter(config: ModelConfig, rank: int, seed: int) -> LoRAAdapter:
    rng = np.random.default_rng(seed)
    weights = {}
    for i in range(config.num_hidden_layers):
        for name, (d_in, d_out) in module_dims(config).items():
            weights[(i, name)] = (rng.standard_normal((rank, d_in), np.float32),
                                  rng.standard_normal((d_out, rank), np.float32))
    return LoRAAdapter(rank, 1.0, weights)


def whole_tree_put(slots: LoRASlots, host: dict, slot: int, adapter: LoRAAdapter) -> Any:
    """The slot filled in the float32 host copy of every slot, the whole tree put again."""
    r, k = slots.max_lora_rank, slot - 1
    for layer in host.values():
        for w in layer.values():
            w["A"][k] = 0
            w["B"][k] = 0
    for (i, name), (a, b) in adapter.weights.items():
        _, fused, part = slots.parts[name]
        _, col, width = slots.layout[fused][1][part]
        w = host[f"layers_{i}"][fused]
        w["A"][k, :, part * r:part * r + adapter.rank] = a.T
        w["B"][k, part * r:part * r + adapter.rank, col:col + width] = b.T
    return jax.device_put(jax.tree.map(lambda x: x.astype(slots.dtype), host))


def tree_bytes(tree: Any) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def measure(config: ModelConfig, dtype: Any, max_loras: int, rank: int, reps: int,
            adapters: list[LoRAAdapter]) -> dict:
    slots = LoRASlots(config, max_loras, rank, dtype)
    for i, adapter in enumerate(adapters, 1):
        slots.add_adapter(i, adapter)
    jax.block_until_ready(slots.device_weights())
    t = time.perf_counter()
    slots.compile_update()
    compile_s = time.perf_counter() - t
    write, put = [], []
    # One more adapter than slots, activated in turn: each misses its slot and evicts the
    # least recently activated one (a first round warms the slots).
    ids = list(range(1, len(adapters) + 1))
    for lid in ids:
        slots.activate(lid, set())
    jax.block_until_ready(slots.device_weights())
    for n in range(reps):
        lid = ids[n % len(ids)]
        assert lid not in slots.slot_of
        t = time.perf_counter()
        slots.activate(lid, set())
        jax.block_until_ready(slots.device_weights())
        write.append(time.perf_counter() - t)
    one_slot = tree_bytes(slots.slot_weights(adapters[0]))
    del slots  # its device tree goes before the comparison's
    layout = LoRASlots(config, max_loras, rank, dtype)  # its layout only
    host = jax.tree.map(lambda x: np.zeros(x.shape, np.float32), layout.abstract())
    device = None
    for n in range(reps + 1):  # the first warms the host copy's pages
        device = None  # the tree it replaces was released first, as the slots did
        t = time.perf_counter()
        device = jax.block_until_ready(
            whole_tree_put(layout, host, n % max_loras + 1, adapters[n % len(adapters)]))
        if n:
            put.append(time.perf_counter() - t)
    del device
    return {"dtype": jnp.dtype(dtype).name,
            "slot_write_s": {"median": statistics.median(write), "min": min(write)},
            "whole_tree_put_s": {"median": statistics.median(put), "min": min(put)},
            "slot_write_compile_s": compile_s,
            "slot_write_bytes": one_slot, "whole_tree_put_bytes": tree_bytes(layout.abstract())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--max-loras", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--intermediate", type=int, default=14336)
    ap.add_argument("--output-json")
    args = ap.parse_args()
    config = ModelConfig(vocab_size=128256, hidden_size=args.hidden,
                         intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                         num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                         head_dim=args.hidden // args.heads, architecture="LlamaForCausalLM",
                         attention_bias=False)
    adapters = [synthetic_adapter(config, args.rank, seed) for seed in range(args.max_loras + 1)]
    cpu = next((line.split(":", 1)[1].strip() for line in
                Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "") if Path("/proc/cpuinfo").exists() else ""
    result = {"backend": jax.default_backend(), "device": str(jax.devices()[0]), "cpu": cpu,
              "shape": {"hidden": args.hidden, "layers": args.layers,
                        "q": args.heads * (args.hidden // args.heads),
                        "kv": args.kv_heads * (args.hidden // args.heads),
                        "intermediate": args.intermediate},
              "max_loras": args.max_loras, "rank": args.rank, "reps": args.reps,
              "runs": [measure(config, getattr(jnp, d), args.max_loras, args.rank, args.reps,
                               adapters) for d in args.dtype]}
    text = json.dumps(result, indent=2)
    print(text)
    if args.output_json:
        Path(args.output_json).write_text(text + "\n")


if __name__ == "__main__":
    main()
