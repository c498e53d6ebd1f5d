"""The runner's persistent InputBatch against the stateless construction it replaced: random
schedules (admit, chunked prefill, prefix hits, preemption, finish, abort) through the real
Scheduler must give identical step inputs, the batch's block tables (one per KV cache group)
must equal the KV manager's at every step but where a sliding group freed a block, and its
sampling rows the sampled requests' own parameters."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxllm.sample.metadata import SamplingMetadata
from jaxllm.sampling_params import SamplingParams
from jaxllm.worker.input_batch import InputBatch
from scheduler import NULL_BLOCK_ID, Request, Scheduler, SchedulerConfig, SchedulerOutput


def stateless_inputs(so: SchedulerOutput, tables: dict[str, tuple[list[int], ...]], padded: int,
                     num_seqs: int, max_blocks: int, bs: int) -> dict:
    """The step inputs built from scratch, one request at a time, from whole block tables (the
    runner's construction before the persistent batch)."""
    num_groups = len(next(iter(tables.values()), ((),)))
    input_ids = np.zeros(padded, np.int32)
    positions = np.zeros(padded, np.int32)
    slot_mapping = np.full((num_groups, padded), -1, np.int32)
    block_tables = np.zeros((num_groups, num_seqs, max_blocks), np.int32)
    seq_lens = np.zeros(num_seqs, np.int32)
    query_start_loc = np.zeros(num_seqs + 1, np.int32)
    logits_indices = np.zeros(num_seqs, np.int32)
    sample_req_ids = []
    offset = 0
    for i, r in enumerate(so.scheduled):
        end = offset + r.num_tokens
        input_ids[offset:end] = r.token_ids
        pos = np.arange(r.start_position, r.seq_len, dtype=np.int32)
        positions[offset:end] = pos
        for g, blocks in enumerate(np.asarray(t, np.int32) for t in tables[r.request_id]):
            block_tables[g, i, :len(blocks)] = blocks
            slot_mapping[g, offset:end] = blocks[pos // bs] * bs + pos % bs
        seq_lens[i] = r.seq_len
        query_start_loc[i + 1] = end
        if r.do_sample:
            logits_indices[len(sample_req_ids)] = end - 1
            sample_req_ids.append(r.request_id)
        offset = end
    query_start_loc[len(so.scheduled) + 1:] = offset
    if num_groups == 1:
        slot_mapping, block_tables = slot_mapping[0], block_tables[0]
    return dict(input_ids=input_ids, positions=positions, slot_mapping=slot_mapping,
                block_tables=block_tables, seq_lens=seq_lens, query_start_loc=query_start_loc,
                logits_indices=logits_indices, sample_req_ids=sample_req_ids)


@settings(max_examples=80, deadline=None)
@given(st.data())
def test_persistent_inputs_equal_stateless_construction(data):
    bs = data.draw(st.sampled_from([2, 4]), label="block_size")
    # KV cache groups: one, or a full group beside sliding ones (whose freed blocks the
    # scheduler's tables show as the null block while the runner keeps their old ids).
    windows = data.draw(st.sampled_from([(None,), (None, 6), (None, 5, 5)]),
                        label="kv_group_windows")
    num_groups = len(windows)
    cfg = SchedulerConfig(
        max_num_seqs=data.draw(st.integers(1, 6), label="max_num_seqs"),
        max_num_batched_tokens=data.draw(st.sampled_from([6, 8, 16, 32]), label="budget"),
        max_model_len=48, block_size=bs,
        # The longest prompt (8 + 14 tokens) must fit the usable blocks.
        num_blocks=data.draw(st.integers(num_groups * (24 // bs + 1) + 1,
                                         num_groups * 64 // bs), label="num_blocks"),
        enable_prefix_caching=data.draw(st.booleans(), label="prefix_caching"),
        kv_group_windows=windows)
    sched = Scheduler(cfg)
    max_blocks = -(-cfg.max_model_len // bs)
    batch = InputBatch(cfg.max_num_seqs, max_blocks, bs, num_groups=num_groups)
    kv = sched.kv_cache_manager
    shared = [1, 2, 3, 4, 5, 6, 7, 8]  # a common prefix, so prefix hits happen
    counter = 0
    for _ in range(data.draw(st.integers(1, 60), label="actions")):
        action = data.draw(st.sampled_from(["add", "abort", "step", "step", "step", "step"]))
        if action == "add":
            prefix = shared[:data.draw(st.integers(0, len(shared)))]
            rest = data.draw(st.lists(st.integers(0, 50), min_size=1, max_size=14))
            params = SamplingParams(
                temperature=data.draw(st.sampled_from([0.0, 0.7, 1.0])),
                top_k=data.draw(st.sampled_from([-1, 5, 50])),
                top_p=data.draw(st.sampled_from([1.0, 0.9])),
                min_p=data.draw(st.sampled_from([0.0, 0.05])),
                logprobs=data.draw(st.sampled_from([None, 0, 3])),
                presence_penalty=data.draw(st.sampled_from([0.0, 0.5])))
            sched.add_request(Request(f"r{counter}", prefix + rest, ignore_eos=True,
                                      max_tokens=data.draw(st.integers(1, 12)),
                                      sampling_params=params))
            counter += 1
        elif action == "abort":
            live = sorted(sched.requests)
            if live:
                sched.abort_requests(data.draw(st.sampled_from(live)))
        else:
            so = sched.schedule()
            batch.update_states(so)
            # The batch holds exactly the running requests, each with the manager's table.
            assert set(batch.req_id_to_row) == {r.request_id for r in sched.running}
            tables = {rid: batch.block_ids(rid) for rid in batch.req_id_to_row}
            for rid, table in tables.items():
                held = kv.get_block_ids(rid)
                assert len(table) == num_groups and all(len(t) == len(h) for t, h in
                                                        zip(table, held, strict=True))
                assert all(b in (t, NULL_BLOCK_ID) for t, h in zip(table, held, strict=True)
                           for t, b in zip(t, h, strict=True))
                assert table[0] == held[0]  # the full group frees nothing
            if so.is_empty:
                sched.update_from_output(so, {})
                continue
            padded = 1 << (so.total_num_scheduled_tokens - 1).bit_length()
            num_seqs = min(padded, cfg.max_num_seqs)
            got = batch.prepare_inputs(so, padded, num_seqs)
            want = stateless_inputs(so, tables, padded, num_seqs, max_blocks, bs)
            for name, value in want.items():
                if name == "sample_req_ids":
                    assert got.sample_req_ids == value
                else:
                    np.testing.assert_array_equal(getattr(got, name), value, err_msg=name)
            want_md = SamplingMetadata.from_params(
                [sched.requests[rid].sampling_params for rid in got.sample_req_ids])
            for name in vars(want_md):
                np.testing.assert_array_equal(getattr(got.sampling, name),
                                              getattr(want_md, name), err_msg=name)
            sampled = {rid: [data.draw(st.integers(0, 50))] for rid in got.sample_req_ids}
            sched.update_from_output(so, sampled)
    # Rows of requests that ended are given back once the scheduler reports them.
    while sched.has_unfinished_requests():
        sched.abort_requests(sorted(sched.requests))
    batch.update_states(sched.schedule())
    assert batch.num_reqs == 0 and not batch.block_table.any()
