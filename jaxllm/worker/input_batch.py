"""InputBatch: the runner's persistent per-request state (vLLM's InputBatch and BlockTable).

A request owns one row of preallocated arrays from the step that schedules it `is_new` (first
time, or again after preemption) until it finishes or is preempted; each step appends the block
ids the scheduler allocated for it. A step's device inputs are then vectorized numpy over those
rows: no Python loop rebuilds block tables, positions or slot mappings.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from itertools import chain

import numpy as np

from jaxllm.sample.metadata import SamplingMetadata
from scheduler import SchedulerOutput


@dataclass
class DeviceInputs:
    """The arrays one step sends to the device, padded to its bucket (T tokens, S sequences):
    `ModelRunner.launch`'s inputs, and what process 0 of a multi-host engine broadcasts to the
    others as one vector (`pack` / `unpack`, field by field)."""

    input_ids: np.ndarray  # [T] int32
    positions: np.ndarray  # [T] int32
    slot_mapping: np.ndarray  # [T] int32, -1 for padding
    block_tables: np.ndarray  # [S, max_blocks_per_seq] int32
    seq_lens: np.ndarray  # [S] int32, 0 for padding
    query_start_loc: np.ndarray  # [S + 1] int32
    logits_indices: np.ndarray  # [S] int32: rows that sample first, then 0

    @staticmethod
    def shapes(num_tokens: int, num_seqs: int, max_blocks_per_seq: int
               ) -> dict[str, tuple[int, ...]]:
        t, s = num_tokens, num_seqs
        return {"input_ids": (t,), "positions": (t,), "slot_mapping": (t,),
                "block_tables": (s, max_blocks_per_seq), "seq_lens": (s,),
                "query_start_loc": (s + 1,), "logits_indices": (s,)}

    def pack(self) -> np.ndarray:
        """Every device field, flattened into one int32 vector."""
        return np.concatenate([getattr(self, f.name).ravel()
                               for f in dataclasses.fields(DeviceInputs)]).astype(np.int32)

    @classmethod
    def unpack(cls, flat: np.ndarray, shapes: dict[str, tuple[int, ...]]) -> DeviceInputs:
        """`pack`'s vector back into arrays of `shapes` (`DeviceInputs.shapes` of its bucket)."""
        names = [f.name for f in dataclasses.fields(DeviceInputs)]
        sizes = [math.prod(shapes[name]) for name in names]
        parts = np.split(flat, np.cumsum(sizes)[:-1])
        return DeviceInputs(**{name: part.reshape(shapes[name])
                               for name, part in zip(names, parts, strict=True)})


@dataclass
class StepInputs(DeviceInputs):
    """One step's device arrays and what the host keeps about them."""

    sample_req_ids: list[str]  # request of each sampled row, in order
    num_tokens: np.ndarray  # [len(scheduled)] tokens of each scheduled request
    sampling: SamplingMetadata  # the sampled rows' parameters, in sample_req_ids order


class InputBatch:
    def __init__(self, max_num_reqs: int, max_blocks_per_seq: int, block_size: int) -> None:
        self.block_size = block_size
        self.max_blocks_per_seq = max_blocks_per_seq
        self.block_table = np.zeros((max_num_reqs, max_blocks_per_seq), np.int32)
        self.num_blocks = np.zeros(max_num_reqs, np.int32)
        self.req_id_to_row: dict[str, int] = {}
        # Each row's sampling parameters, written once when its request gets the row.
        self.sampling = SamplingMetadata.empty(max_num_reqs)
        # Lowest free row on top, so live rows stay packed at the front.
        self._free_rows = list(range(max_num_reqs - 1, -1, -1))

    @property
    def num_reqs(self) -> int:
        return len(self.req_id_to_row)

    def block_ids(self, request_id: str) -> list[int]:
        row = self.req_id_to_row[request_id]
        return self.block_table[row, :self.num_blocks[row]].tolist()

    def update_states(self, scheduler_output: SchedulerOutput) -> None:
        """Apply a step's schedule: drop finished and preempted requests, give new ones a row
        with their whole block table, append the new blocks of continuing ones."""
        for rid in chain(scheduler_output.finished_req_ids, scheduler_output.preempted_req_ids):
            self._remove(rid)
        for r in scheduler_output.scheduled:
            if r.is_new:
                self._remove(r.request_id)  # a stale row must never leak into a new one
                if not self._free_rows:
                    raise RuntimeError(f"input batch full: {self.num_reqs} rows for request "
                                       f"{r.request_id!r}")
                row = self._free_rows.pop()
                self.req_id_to_row[r.request_id] = row
                self.sampling.set_row(row, r.sampling_params)
            else:
                row = self.req_id_to_row[r.request_id]
            new = r.new_block_ids
            if new:
                start = int(self.num_blocks[row])
                if start + len(new) > self.max_blocks_per_seq:
                    raise RuntimeError(f"request {r.request_id!r}: {start + len(new)} blocks "
                                       f"exceed max_model_len's {self.max_blocks_per_seq}")
                self.block_table[row, start:start + len(new)] = new
                self.num_blocks[row] = start + len(new)

    def _remove(self, request_id: str) -> None:
        row = self.req_id_to_row.pop(request_id, None)
        if row is None:
            return
        self.block_table[row, :self.num_blocks[row]] = 0
        self.num_blocks[row] = 0
        self._free_rows.append(row)

    def prepare_inputs(self, scheduler_output: SchedulerOutput, padded_tokens: int,
                       num_seqs: int) -> StepInputs:
        """The step's device inputs (after update_states), in the scheduler's request order."""
        reqs = scheduler_output.scheduled
        n = len(reqs)
        total = scheduler_output.total_num_scheduled_tokens
        bs = self.block_size
        rows = np.fromiter((self.req_id_to_row[r.request_id] for r in reqs), np.intp, n)
        num_tokens = np.fromiter((len(r.token_ids) for r in reqs), np.int32, n)
        starts = np.fromiter((r.start_position for r in reqs), np.int32, n)

        query_start_loc = np.full(num_seqs + 1, total, np.int32)
        query_start_loc[0] = 0
        np.cumsum(num_tokens, out=query_start_loc[1:n + 1])
        input_ids = np.zeros(padded_tokens, np.int32)
        input_ids[:total] = np.fromiter(chain.from_iterable(r.token_ids for r in reqs),
                                        np.int32, total)
        # Each token's request, then its position: start + offset within the request.
        req_of_token = np.repeat(np.arange(n), num_tokens)
        positions = np.zeros(padded_tokens, np.int32)
        pos = (np.arange(total, dtype=np.int32) - query_start_loc[req_of_token]
               + starts[req_of_token])
        positions[:total] = pos
        slot_mapping = np.full(padded_tokens, -1, np.int32)
        slot_mapping[:total] = self.block_table[rows[req_of_token], pos // bs] * bs + pos % bs
        block_tables = np.zeros((num_seqs, self.max_blocks_per_seq), np.int32)
        np.take(self.block_table, rows, axis=0, out=block_tables[:n])
        seq_lens = np.zeros(num_seqs, np.int32)
        seq_lens[:n] = starts + num_tokens
        sampling = np.flatnonzero(np.fromiter((r.do_sample for r in reqs), bool, n))
        logits_indices = np.zeros(num_seqs, np.int32)
        logits_indices[:len(sampling)] = query_start_loc[sampling + 1] - 1
        return StepInputs(input_ids, positions, slot_mapping, block_tables, seq_lens,
                          query_start_loc, logits_indices,
                          [reqs[i].request_id for i in sampling], num_tokens,
                          self.sampling.rows(rows[sampling]))
