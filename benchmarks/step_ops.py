"""Kernels per layer of a decode step: what each launch of the step costs in launches.

    python benchmarks/step_ops.py [--shape qwen2.5-0.5b] [--num-tokens 1 64] [--output-json F]

Two programs of the same decode step, read from their HLO text:

- `cuda_lowered`: the step with the Pallas kernels lowered for CUDA (no GPU needed), before
  XLA's GPU passes: its dots (cuBLAS or Triton GEMMs on the GPU) and custom calls (our Pallas
  kernels, one launch each), and the other top-level ops XLA will fuse into kernels;
- `cpu_compiled`: the step XLA compiled for this CPU (the runner's own executable): fusions
  (one loop each), dots and custom calls (our C++ kernels) as the CPU runs them.

Each instruction of the entry computation counts once (a `call` for what it calls), for its
layer (named by its metadata or the layer weights it reads) or for `outside` (embedding, final
norm, LM head, top-K). The table shows the counts most layers have (and which layers differ:
the first has no residual to add), the layers' total and the rest. A GPU trace (docs/gpu.md,
the trace part) gives the kernels the GPU really ran."""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# The kinds of top-level HLO instructions that become work on the device; parameters,
# constants, tuples and bitcasts do not.
_COUNTED = ("fusion", "dot", "custom-call", "convolution")
_OP = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*.*?\s([a-z][\w\-]*)\(")
_LAYER = re.compile(r"/layers_(\d+)/")
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_TO_APPLY = re.compile(r"to_apply=%?([\w.\-]+)")
# Instructions that launch nothing: views, bookkeeping.
_FREE = ("parameter", "constant", "tuple", "get-tuple-element", "bitcast", "after-all",
         "reshape")
_OP_NAME = re.compile(r'op_name="([^"]+)"')
_PARAM_LAYER = re.compile(r"params__layers_(\d+)__")
_PARAM_OUTSIDE = re.compile(r"params__(?:norm|embed_tokens|lm_head)__")


def computations(hlo_text: str) -> dict[str, list[str]]:
    """The HLO module's computations by name (the entry one as "ENTRY"): their instruction
    lines."""
    comps: dict[str, list[str]] = {}
    body: list[str] | None = None
    for line in hlo_text.splitlines():
        if body is None:
            if line.endswith("{") and not line.startswith((" ", "HloModule")):
                words = line.split()
                name = "ENTRY" if words[0] == "ENTRY" else words[0].lstrip("%")
                body = comps.setdefault(name, [])
        elif line.startswith("}"):
            body = None
        else:
            body.append(line)
    if "ENTRY" not in comps:
        raise ValueError("no ENTRY computation in this HLO text")
    return comps


def _where(line: str) -> str | None:
    """The layer an instruction belongs to: from its metadata, else from the weights it reads
    (XLA drops metadata from some ops, and lowering keeps none), else None (unknown: the
    instruction belongs where the one before it does, the unrolled layers being in order)."""
    name = _OP_NAME.search(line)
    layer = _LAYER.search(name.group(1)) if name else None
    if layer is None:
        layer = _PARAM_LAYER.search(line)
    if layer is not None:
        return layer.group(1)
    return "outside" if _PARAM_OUTSIDE.search(line) else None


def count_step_ops(hlo_text: str) -> dict[str, Counter[str]]:
    """Per layer ("0", "1", ...; "outside" for the rest): instruction kind -> count, over the
    entry computation and the computations it `call`s (inlined: lowering keeps each kernel's
    jit as a call); every other instruction that does work counts as `other`. Custom calls are
    also counted by target (`custom-call:<target>`)."""
    comps = computations(hlo_text)
    per: dict[str, Counter[str]] = {}

    def visit(lines: list[str], counts: Counter[str]) -> None:
        for line in lines:
            m = _OP.match(line)
            if m is None:
                continue
            kind = m.group(1)
            if kind == "call":
                callee = _TO_APPLY.search(line)
                if callee is not None and callee.group(1) in comps:
                    visit(comps[callee.group(1)], counts)
                    continue
            if kind in _FREE:
                continue
            counts[kind if kind in _COUNTED else "other"] += 1
            if kind == "custom-call":
                target = _TARGET.search(line)
                counts[f"custom-call:{target.group(1) if target else '?'}"] += 1

    current = "outside"
    for line in comps["ENTRY"]:
        where = _where(line)
        current = current if where is None else where
        visit([line], per.setdefault(current, Counter()))
    return {k: v for k, v in per.items() if v}


def summarize(per: dict[str, Counter[str]]) -> dict[str, Any]:
    """The counts most layers have, the layers that differ from them, the layers' total and
    the rest."""
    layers = sorted((k for k in per if k != "outside"), key=int)
    total: Counter[str] = Counter()
    for k in layers:
        total.update(per[k])
    common = Counter(tuple(sorted(per[k].items())) for k in layers).most_common(1)
    typical = dict(common[0][0]) if common else {}
    return {"num_layers": len(layers), "per_layer": typical,
            "layers_differing": {k: dict(per[k]) for k in layers if dict(per[k]) != typical},
            "layers_total": dict(total), "outside": dict(per.get("outside", Counter())),
            "step_total": sum(v for c in per.values() for k, v in c.items()
                              if ":" not in k)}


def measure(shape_name: str, num_tokens: int) -> dict[str, Any]:
    import jax.numpy as jnp

    from benchmarks.dispatch import zero_runner
    from jaxllm.model_executor.config import ModelConfig
    from jaxllm.worker.lowering import lower_step_for_cuda
    from pallas_kernels.checks.shapes import QWEN2_SHAPES

    shape = QWEN2_SHAPES[shape_name]
    config = ModelConfig.from_hf_config(shape.hf_config(max_position_embeddings=4096,
                                                        rope_theta=1e6, rms_norm_eps=1e-6))
    lowered = lower_step_for_cuda(config, num_tokens, True, dtype=jnp.bfloat16)
    cuda = summarize(count_step_ops(lowered.compiler_ir("hlo").as_hlo_text()))
    runner = zero_runner(shape_name, "float32")
    compiled = runner.lower_step(num_tokens, 1, runner.num_kv_blocks).compile()
    cpu = summarize(count_step_ops(compiled.as_text()))
    return {"num_tokens": num_tokens, "cuda_lowered": cuda, "cpu_compiled": cpu}


def _row(counts: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))


def main(argv: list[str] | None = None) -> int:
    from pallas_kernels.checks.shapes import QWEN2_SHAPES

    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--shape", default="qwen2.5-0.5b", choices=sorted(QWEN2_SHAPES))
    parser.add_argument("--num-tokens", type=int, nargs="+", default=[1])
    parser.add_argument("--output-json", default=None)
    ns = parser.parse_args(argv)
    results = [measure(ns.shape, t) for t in ns.num_tokens]
    for r in results:
        for program in ("cuda_lowered", "cpu_compiled"):
            s = r[program]
            print(f"decode bucket {r['num_tokens']}, {program}: {s['step_total']} ops a step; "
                  f"per layer ({s['num_layers']} layers; differing: "
                  f"{sorted(s['layers_differing'], key=int)}): "
                  f"{_row(s['per_layer'])}; outside the layers: {_row(s['outside'])}")
    if ns.output_json:
        Path(ns.output_json).write_text(json.dumps({"shape": ns.shape, "results": results},
                                                   indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
