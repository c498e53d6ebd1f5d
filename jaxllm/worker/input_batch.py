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
from typing import Any

import numpy as np

from jaxllm.sample.metadata import SamplingMetadata
from scheduler import SchedulerOutput


@dataclass
class DeviceInputs:
    """The arrays one step sends to the device, padded to its bucket (T tokens, S sequences).
    They travel as one int32 vector (`pack`): one host-to-device transfer and one argument per
    step, split again inside the step (`unpack`, static slices); the same vector is what process
    0 of a multi-host engine broadcasts to the others."""

    input_ids: np.ndarray  # [T] int32
    positions: np.ndarray  # [T] int32
    # With several KV cache groups these two lead with a group axis ([G, T], [G, S, blocks]).
    slot_mapping: np.ndarray  # [T] int32, -1 for padding
    block_tables: np.ndarray  # [S, max_blocks_per_seq] int32
    seq_lens: np.ndarray  # [S] int32, 0 for padding
    query_start_loc: np.ndarray  # [S + 1] int32
    # [R] int32: the token rows whose logits are sampled (with draft tokens, a request's last
    # 1 + d tokens), then 0
    logits_indices: np.ndarray

    @staticmethod
    def shapes(num_tokens: int, num_seqs: int, num_rows: int, max_blocks_per_seq: int,
               lora: bool = False, num_groups: int = 1) -> dict[str, tuple[int, ...]]:
        """Each field's shape, in packing order; with `lora`, each token's adapter slot
        (`StepInputs.lora_slots`) last."""
        t, s = num_tokens, num_seqs
        g = () if num_groups == 1 else (num_groups,)
        shapes = {"input_ids": (t,), "positions": (t,), "slot_mapping": (*g, t),
                  "block_tables": (*g, s, max_blocks_per_seq), "seq_lens": (s,),
                  "query_start_loc": (s + 1,), "logits_indices": (num_rows,)}
        if lora:
            shapes["lora_slots"] = (t,)
        return shapes

    def pack(self) -> np.ndarray:
        """Every device field, flattened into one int32 vector."""
        arrays = [getattr(self, f.name).ravel() for f in dataclasses.fields(DeviceInputs)]
        lora_slots = getattr(self, "lora_slots", None)
        if lora_slots is not None:
            arrays.append(lora_slots)
        return np.concatenate(arrays, dtype=np.int32)

    @staticmethod
    def unpack(flat: Any, shapes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
        """`pack`'s vector (numpy, or a traced jax array inside the step) back into the fields'
        arrays of `shapes` (`DeviceInputs.shapes` of its bucket), by name."""
        need = DeviceInputs.packed_size(shapes)
        if flat.shape != (need,):
            raise ValueError(f"packed step inputs hold {flat.shape} values; the bucket's "
                             f"fields take ({need},)")
        out, start = {}, 0
        for name, shape in shapes.items():
            size = math.prod(shape)
            out[name] = flat[start:start + size].reshape(shape)
            start += size
        return out

    @staticmethod
    def packed_size(shapes: dict[str, tuple[int, ...]]) -> int:
        """Values in `pack`'s vector for a bucket of these `shapes`."""
        return sum(math.prod(s) for s in shapes.values())


@dataclass
class StepInputs(DeviceInputs):
    """One step's device arrays and what the host keeps about them."""

    sample_req_ids: list[str]  # each request that samples this step, in order
    num_tokens: np.ndarray  # [len(scheduled)] tokens of each scheduled request
    sampling: SamplingMetadata  # the sampling requests' parameters, in sample_req_ids order
    # Speculative decoding: each sampling request's first logits row, and how many of its
    # drafts have a row to be verified in (all of them unless the step's rows ran out: the
    # others count as rejected); their draft tokens.
    sample_rows: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.intp))
    num_verified_drafts: np.ndarray = dataclasses.field(
        default_factory=lambda: np.zeros(0, np.intp))
    draft_token_ids: list[list[int]] = dataclasses.field(default_factory=list)
    # [T] int32, each token's LoRA slot (0: no adapter), packed last; None without LoRA.
    lora_slots: np.ndarray | None = None

    @property
    def num_sampled_rows(self) -> int:
        return len(self.sample_req_ids) + int(self.num_verified_drafts.sum())


class InputBatch:
    def __init__(self, max_num_reqs: int, max_blocks_per_seq: int, block_size: int,
                 lora: bool = False, num_groups: int = 1) -> None:
        self.block_size = block_size
        self.max_blocks_per_seq = max_blocks_per_seq
        # One table per KV cache group, all of one length per row.
        self.num_groups = num_groups
        self.block_table = np.zeros((num_groups, max_num_reqs, max_blocks_per_seq), np.int32)
        self.num_blocks = np.zeros(max_num_reqs, np.int32)
        self.req_id_to_row: dict[str, int] = {}
        # Each row's sampling parameters, written once when its request gets the row.
        self.sampling = SamplingMetadata.empty(max_num_reqs)
        # Lowest free row on top, so live rows stay packed at the front.
        self._free_rows = list(range(max_num_reqs - 1, -1, -1))
        # With LoRA: each row's adapter id and the slot the runner loaded it into.
        self.lora = lora
        self.lora_id = np.zeros(max_num_reqs, np.int64)
        self.lora_slot = np.zeros(max_num_reqs, np.int32)

    def live_lora_ids(self) -> set[int]:
        """The adapters the live rows run with."""
        return {int(self.lora_id[row]) for row in self.req_id_to_row.values()} - {0}

    @property
    def num_reqs(self) -> int:
        return len(self.req_id_to_row)

    def block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The request's block table in each group."""
        row = self.req_id_to_row[request_id]
        return tuple(self.block_table[:, row, :self.num_blocks[row]].tolist())

    def update_states(self, scheduler_output: SchedulerOutput) -> None:
        """Apply a step's schedule: drop finished and preempted requests, give new ones a row
        with their whole block table, append the new blocks of continuing ones."""
        for rid in chain(scheduler_output.finished_req_ids, scheduler_output.preempted_req_ids):
            self._remove(rid)
        for rid, kept in scheduler_output.truncated_block_tables.items():
            row = self.req_id_to_row.get(rid)
            if row is not None and kept < self.num_blocks[row]:
                self.block_table[:, row, kept:self.num_blocks[row]] = 0
                self.num_blocks[row] = kept
        for r in scheduler_output.scheduled:
            if r.is_new:
                self._remove(r.request_id)  # a stale row must never leak into a new one
                if not self._free_rows:
                    raise RuntimeError(f"input batch full: {self.num_reqs} rows for request "
                                       f"{r.request_id!r}")
                row = self._free_rows.pop()
                self.req_id_to_row[r.request_id] = row
                self.sampling.set_row(row, r.sampling_params)
                self.lora_id[row] = r.lora_int_id
            else:
                row = self.req_id_to_row[r.request_id]
            new = r.new_block_ids
            if len(new) != self.num_groups:
                raise RuntimeError(f"request {r.request_id!r}: block ids for {len(new)} KV "
                                   f"cache groups, the runner has {self.num_groups}")
            num_new = len(new[0])
            if num_new:
                start = int(self.num_blocks[row])
                if start + num_new > self.max_blocks_per_seq:
                    raise RuntimeError(f"request {r.request_id!r}: {start + num_new} blocks "
                                       f"exceed max_model_len's {self.max_blocks_per_seq}")
                self.block_table[:, row, start:start + num_new] = new
                self.num_blocks[row] = start + num_new

    def _remove(self, request_id: str) -> None:
        row = self.req_id_to_row.pop(request_id, None)
        if row is None:
            return
        self.block_table[:, row, :self.num_blocks[row]] = 0
        self.num_blocks[row] = 0
        self.lora_id[row] = self.lora_slot[row] = 0
        self._free_rows.append(row)

    def prepare_inputs(self, scheduler_output: SchedulerOutput, padded_tokens: int,
                       num_seqs: int, num_rows: int | None = None) -> StepInputs:
        """The step's device inputs (after update_states), in the scheduler's request order;
        `num_rows` logits rows (default `num_seqs`)."""
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
        g = self.num_groups
        slot_mapping = np.full((g, padded_tokens), -1, np.int32)
        slot_mapping[:, :total] = (self.block_table[:, rows[req_of_token], pos // bs] * bs
                                   + pos % bs)
        block_tables = np.zeros((g, num_seqs, self.max_blocks_per_seq), np.int32)
        np.take(self.block_table, rows, axis=1, out=block_tables[:, :n])
        if g == 1:
            slot_mapping, block_tables = slot_mapping[0], block_tables[0]
        seq_lens = np.zeros(num_seqs, np.int32)
        seq_lens[:n] = starts + num_tokens
        sampling = np.flatnonzero(np.fromiter((r.do_sample for r in reqs), bool, n))
        num_rows = num_seqs if num_rows is None else num_rows
        logits_indices = np.zeros(num_rows, np.int32)
        last = query_start_loc[sampling + 1] - 1
        lora_slots = None
        if self.lora:
            lora_slots = np.zeros(padded_tokens, np.int32)
            lora_slots[:total] = self.lora_slot[rows[req_of_token]]
        if not scheduler_output.total_num_draft_tokens:
            logits_indices[:len(sampling)] = last
            return StepInputs(input_ids, positions, slot_mapping, block_tables, seq_lens,
                              query_start_loc, logits_indices,
                              [reqs[i].request_id for i in sampling], num_tokens,
                              self.sampling.rows(rows[sampling]),
                              np.arange(len(sampling)), np.zeros(len(sampling), np.intp), [],
                              lora_slots)
        num_drafts = np.fromiter((reqs[i].num_draft_tokens for i in sampling.tolist()),
                                 np.intp, len(sampling))
        # Rows left beyond one per sampling request go to drafts in request order; drafts
        # without a row are verified as rejected.
        spare = num_rows - len(sampling)
        verified = np.minimum(num_drafts, np.maximum(0, spare - (np.cumsum(num_drafts)
                                                                 - num_drafts)))
        per_req = 1 + verified
        sample_rows = np.cumsum(per_req) - per_req
        # Request i's rows: tokens last - num_drafts[i] ... last - num_drafts[i] + verified[i].
        first = last - num_drafts
        offset = np.arange(int(per_req.sum())) - np.repeat(sample_rows, per_req)
        logits_indices[:int(per_req.sum())] = np.repeat(first, per_req) + offset
        drafts = [reqs[i].token_ids[-reqs[i].num_draft_tokens:][:v] if v else []
                  for i, v in zip(sampling.tolist(), verified.tolist(), strict=True)]
        return StepInputs(input_ids, positions, slot_mapping, block_tables, seq_lens,
                          query_start_loc, logits_indices,
                          [reqs[i].request_id for i in sampling], num_tokens,
                          self.sampling.rows(rows[sampling]), sample_rows, verified, drafts,
                          lora_slots)
