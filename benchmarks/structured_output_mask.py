"""The per-step cost of structured outputs on the host: the batched mask fill of every
constrained sampled row (`StructuredOutputManager.grammar_bitmask`, one llguidance call) and
applying the masks, on the top-K candidates (`mask_candidates` + `exact_rows`) and on full rows
(the `TokenMask`s, built while the step runs, then the full-row sampler's row processing: the
masked copy of the row), at 1, 64 and
256 rows of the real 151,936-token vocabulary (tiny-qwen2's tokenizer is the embedded model's).

Matchers sit in mid-output states, cycled over the rows: for a JSON schema inside a string,
between keys, inside a number and inside an array; for a regex inside its local part and inside
its domain. Median of 20 after a warm-up.

    python benchmarks/structured_output_mask.py [ROWS ...]   (default: 1 64 256)

Prints a table and writes benchmarks/results/structured_output_mask.json.
"""
import json
import os
import platform
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from jaxllm.benchmarks.common import repeat_ms  # noqa: E402
from jaxllm.model_executor.model_loader.tiny_model import tiny_qwen2_path  # noqa: E402
from jaxllm.model_executor.model_loader.tokenizer import load_tokenizer  # noqa: E402
from jaxllm.sample.candidates import TopKLogits, exact_rows, mask_candidates  # noqa: E402
from jaxllm.sample.metadata import SamplingMetadata  # noqa: E402
from jaxllm.sample.sampler import SamplingRow, _process_row  # noqa: E402
from jaxllm.sample.token_mask import TokenMask  # noqa: E402
from jaxllm.sampling_params import SamplingParams, StructuredOutputsParams  # noqa: E402
from jaxllm.structured_output.manager import StructuredOutputManager  # noqa: E402
from jaxllm.structured_output.request import StructuredOutputRequest  # noqa: E402

VOCAB = 151936
EOS = [151645, 151643]
TOPK = 64
GREEDY = SamplingParams(temperature=0.0)
SCHEMA = {"type": "object", "additionalProperties": False,
          "required": ["name", "email", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 40},
                         "email": {"type": "string", "format": "email"},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "tags": {"type": "array", "items": {"type": "string"},
                                  "maxItems": 8}}}
REGEX = r"[a-z][a-z0-9._]{0,30}@[a-z0-9]{1,20}\.(com|org|net|io)"
CASES = {
    "json schema": (StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
                    ['{"name":"Ada Lov', '{"name":"Ada Lovelace",',
                     '{"name":"Ada","email":"ada@x.org","age":3',
                     '{"name":"Ada","email":"ada@x.org","age":36,"tags":["math","e']),
    "regex": (StructuredOutputsParams(regex=REGEX), ["ada.love", "ada.lovelace@analyt"]),
}


def median_ms(f, reps: int = 20) -> float:
    return float(np.median(repeat_ms(f, reps)))


def main() -> None:
    rows_list = [int(a) for a in sys.argv[1:]] or [1, 64, 256]
    path = tiny_qwen2_path()
    tokenizer = load_tokenizer(path)
    manager = StructuredOutputManager(path, VOCAB, max(rows_list))
    rng = np.random.default_rng(0)
    results = []
    print(f"{'constraint':12s} {'rows':>5s} {'fill ms':>9s} {'top-K apply ms':>15s} "
          f"{'full-row prep ms':>15s} {'full-row apply ms':>18s} {'allowed/row':>12s}")
    for name, (params, prefixes) in CASES.items():
        states = []
        for prefix in prefixes:
            so = manager.add_request(params, EOS)
            assert manager.init_matcher(so), so.error
            assert so.accept_tokens(tokenizer.encode(prefix)), (prefix, so.error)
            states.append(so)
        for rows in rows_list:
            # One matcher per row, as each request has its own.
            reqs = [StructuredOutputRequest(so.grammar, so.compiled, so.matcher.deep_copy())
                    for so in (states[i % len(states)] for i in range(rows))]
            fill = median_ms(lambda reqs=reqs: manager.grammar_bitmask(reqs))
            bitmask, errors = manager.grammar_bitmask(reqs)
            assert not any(errors), errors
            bitmask = bitmask.copy()
            allowed_per_row = float(np.mean([
                np.unpackbits(b.view(np.uint8), bitorder="little")[:VOCAB].sum()
                for b in bitmask[:len(states)]]))
            x = rng.normal(0, 3, (rows, VOCAB)).astype(np.float32)
            order = np.argsort(-x, axis=1)[:, :TOPK]
            vals = np.take_along_axis(x, order, 1)
            topk = TopKLogits(vals, order.astype(np.int32), np.zeros(rows, np.float32))
            metadata = SamplingMetadata.from_params([GREEDY] * rows)
            every = np.arange(rows)

            def on_candidates(topk=topk, bitmask=bitmask, metadata=metadata, every=every):
                masked = mask_candidates(topk, every, bitmask)
                exact_rows(metadata, np.zeros(len(every), bool), topk, masked)

            def full_row_masks(bitmask=bitmask):
                return [TokenMask.from_bitmask(b, VOCAB) for b in bitmask]

            masks = full_row_masks()

            def on_full_rows(x=x, masks=masks):
                for r in range(len(x)):  # row by row, as `sample` processes them
                    _process_row(x[r], SamplingRow(GREEDY, None, mask=masks[r]))

            cand = median_ms(on_candidates)
            prep, full = median_ms(full_row_masks, reps=5), median_ms(on_full_rows, reps=5)
            print(f"{name:12s} {rows:5d} {fill:9.3f} {cand:15.3f} {prep:15.3f} {full:18.3f} "
                  f"{allowed_per_row:12.0f}")
            results.append({"constraint": name, "rows": rows, "fill_ms": fill,
                            "topk_apply_ms": cand, "full_row_mask_prep_ms": prep,
                            "full_row_apply_ms": full,
                            "allowed_tokens_per_row": allowed_per_row})
    manager.shutdown()
    out = Path(__file__).resolve().parent / "results" / "structured_output_mask.json"
    out.write_text(json.dumps({"machine": platform.processor() or platform.machine(),
                               "cpus": os.cpu_count(), "results": results}, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
