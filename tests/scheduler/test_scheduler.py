"""Scheduler driven by a fake model whose next token is a function of the whole token history.

The fake runner keeps its own paged 'KV' (token ids stored at the slots the scheduler hands it,
in every KV cache group's block, tagged with the group) and reads a request's history back
through its block tables only (a sliding group only its window), so a wrong block table, a bad
prefix-cache hit, a block read by a group that did not write it or a reused block that was
still needed changes the generated tokens or fails the read.
"""

from __future__ import annotations

import pickle
import random
from collections import Counter
from dataclasses import dataclass, field, replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler import (
    NULL_BLOCK_ID,
    FinishAfter,
    Request,
    RequestStatus,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
    prompt_blocks_needed,
)
from scheduler.block_pool import hash_block_tokens
from scheduler.kv_cache_manager import KVCacheManager

VOCAB = 40
EOS = 0


def fake_next(history: list[int]) -> int:
    h = 17
    for t in history:
        h = (h * 31 + t + 1) % 1_000_003
    return h % VOCAB


@dataclass
class Spec:
    """A request's parameters, so each run builds fresh Request objects."""

    rid: str
    prompt: list[int]
    max_tokens: int = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    eos_token_id: int | None = EOS
    stop_token_ids: list[int] = field(default_factory=list)
    arrival_step: int = 0
    lora_int_id: int = 0

    def make(self) -> Request:
        return Request(
            self.rid,
            list(self.prompt),
            max_tokens=self.max_tokens,
            min_tokens=self.min_tokens,
            ignore_eos=self.ignore_eos,
            eos_token_id=self.eos_token_id,
            stop_token_ids=self.stop_token_ids,
            lora_int_id=self.lora_int_id,
        )


def model_input(tokens: list[int], windows: tuple[int | None, ...]) -> list[int]:
    """What the fake model's next token depends on: what every KV cache group reads (a full
    group all positions, a sliding group of window W the last W), in group order, group g's
    token t counted as g * VOCAB + t. One full group reads just the tokens."""
    return [g * VOCAB + t for g, w in enumerate(windows) for t in (tokens[-w:] if w else tokens)]


def reference(spec: Spec, max_model_len: int, windows: tuple[int | None, ...] = (None,)
              ) -> tuple[list[int], str, int | None]:
    """The same generation, one request at a time, with the stop rules spelled out again
    (`windows`: each KV cache group's attention window, as in kv_group_windows)."""
    tokens, out = list(spec.prompt), []
    while True:
        t = fake_next(model_input(tokens, windows))
        tokens.append(t)
        out.append(t)
        if len(out) >= spec.min_tokens:
            if not spec.ignore_eos and t == spec.eos_token_id:
                return out, "stop", None
            if t in spec.stop_token_ids:
                return out, "stop", t
        if len(out) >= spec.max_tokens or len(tokens) >= max_model_len:
            return out, "length", None


class FakeRunner:
    def __init__(self, cfg: SchedulerConfig) -> None:
        self.bs = cfg.block_size
        # Each KV cache group's window: its layers read only the last `window` positions.
        self.windows = tuple(cfg.kv_group_windows)
        # Each slot holds (group, token): the group whose layers wrote it, so a group reading
        # a block another group wrote (a block shared across groups, a hit on another group's
        # block) is caught.
        self.kv: list[list[tuple[int, int] | None]] = [
            [None] * self.bs for _ in range(cfg.num_blocks)]
        # Block tables, one per group, kept as a runner keeps them: only from each step's
        # new_block_ids.
        self.tables: dict[str, list[list[int]]] = {}

    def update_tables(self, out: SchedulerOutput) -> None:
        for rid in [*out.finished_req_ids, *out.preempted_req_ids]:
            self.tables.pop(rid, None)
        for item in out.scheduled:
            assert len(item.new_block_ids) == len(self.windows)
            if item.is_new:
                assert item.request_id not in self.tables
                self.tables[item.request_id] = [list(ids) for ids in item.new_block_ids]
            else:
                for table, ids in zip(self.tables[item.request_id], item.new_block_ids,
                                      strict=True):
                    table.extend(ids)

    def read(self, table: list[int], group: int, start: int, end: int) -> list[int]:
        """Group `group`'s tokens at positions start..end-1, through its block table."""
        bs = self.bs
        history = []
        for p in range(start, end):
            slot = self.kv[table[p // bs]][p % bs]
            assert slot is not None and slot[0] == group, (
                f"group {group} reads position {p} in block {table[p // bs]}, holding {slot}")
            history.append(slot[1])
        return history

    def execute(self, out: SchedulerOutput) -> dict[str, list[int]]:
        bs = self.bs
        # All writes of the batch land before any read, as in one batched forward pass; each
        # token's KV goes into every group's block of its position.
        for item in out.scheduled:
            for g, table in enumerate(self.tables[item.request_id]):
                for j, tok in enumerate(item.token_ids):
                    p = item.start_position + j
                    assert table[p // bs] != NULL_BLOCK_ID
                    self.kv[table[p // bs]][p % bs] = (g, tok)
        sampled = {}
        for item in out.scheduled:
            if item.do_sample:
                end = item.seq_len
                seen = [g * VOCAB + t
                        for g, (table, w) in enumerate(zip(self.tables[item.request_id],
                                                           self.windows, strict=True))
                        for t in self.read(table, g, max(0, end - w) if w else 0, end)]
                sampled[item.request_id] = [fake_next(seen)]
        return sampled


@dataclass
class RunStats:
    steps: int = 0
    preemptions: int = 0
    partial_prefills: int = 0
    cache_hit_tokens: int = 0
    resumed_with_hits: int = 0
    max_batch: int = 0
    freed_blocks: int = 0  # the most out-of-window blocks one request had freed, any group
    # The same per KV cache group.
    group_freed_blocks: Counter[int] = field(default_factory=Counter)


def leading_nulls(ids: list[int]) -> int:
    return next((i for i, b in enumerate(ids) if b != NULL_BLOCK_ID), len(ids))


def check_pool(sched: Scheduler, runner: FakeRunner | None = None,
               cached_kv: dict[bytes, tuple] | None = None) -> None:
    """The pool's invariants over every KV cache group; with the runner, also that the blocks
    sharing a prefix-cache key hold the same KV (one group's, of the same tokens), ever."""
    kv = sched.kv_cache_manager
    windows = sched.config.kv_group_windows
    pool = kv.block_pool
    holders: Counter[int] = Counter()
    group_of: dict[int, int] = {}
    for rid in kv.req_to_blocks:
        tables = kv.get_block_ids(rid)
        assert len(tables) == len(windows)
        assert len({len(ids) for ids in tables}) == 1, f"{rid}: tables of unequal lengths"
        mine: list[int] = []
        for g, (ids, w) in enumerate(zip(tables, windows, strict=True)):
            lead = leading_nulls(ids)
            # Blocks out of a sliding window are freed: the null block holds their place, a
            # leading run; never in a group of full attention.
            assert w is not None or lead == 0, f"{rid}: group {g} (full) freed blocks"
            held = ids[lead:]
            assert NULL_BLOCK_ID not in held, f"{rid}: group {g}'s null block not leading"
            for b in held:
                assert group_of.setdefault(b, g) == g, f"block {b} held in two groups"
            mine += held
        assert len(mine) == len(set(mine)), f"{rid}: a block held twice"
        holders.update(mine)
    assert set(kv.req_to_blocks) == {r.request_id for r in sched.running}
    for blk in pool.blocks[1:]:
        assert blk.ref_cnt == holders[blk.block_id]
        assert (blk.ref_cnt == 0) == (blk.block_id in pool.free_queue)
    assert pool.null_block.ref_cnt == 1 and NULL_BLOCK_ID not in pool.free_queue
    if runner is not None and cached_kv is not None:
        for key, copies in pool.cached_blocks.items():
            for bid in copies:
                content = tuple(runner.kv[bid])
                assert None not in content and len({g for g, _ in content}) == 1
                assert cached_kv.setdefault(key, content) == content, (
                    f"block {bid} cached under a key whose blocks held {cached_kv[key]}, "
                    f"holds {content}")
    # The order the preemption choice relies on (see Scheduler's docstring).
    arrivals = [r.arrival_index for r in sched.running] + [r.arrival_index for r in sched.waiting]
    assert arrivals == sorted(arrivals)


def check_step(sched: Scheduler, out: SchedulerOutput, tables: dict[str, list[list[int]]],
               stats: RunStats) -> None:
    cfg = sched.config
    bs = cfg.block_size
    kv = sched.kv_cache_manager
    pool = kv.block_pool
    ids = [item.request_id for item in out.scheduled]
    assert len(ids) == len(set(ids))
    assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values())
    assert out.total_num_scheduled_tokens == sum(item.num_tokens for item in out.scheduled)
    assert out.total_num_draft_tokens == sum(item.num_draft_tokens for item in out.scheduled)
    assert out.total_num_scheduled_tokens <= cfg.max_num_batched_tokens
    assert len(out.scheduled) <= cfg.max_num_seqs and len(sched.running) <= cfg.max_num_seqs
    assert not set(out.preempted_req_ids) & set(ids)
    assert set(out.num_cached_tokens) == {i.request_id for i in out.scheduled if i.is_new}
    for rid in out.preempted_req_ids:
        req = sched.requests[rid]
        assert req.status == RequestStatus.PREEMPTED and req.num_computed_tokens == 0
        assert all(ids == [] for ids in kv.get_block_ids(rid))
    for item in out.scheduled:
        req = sched.requests[item.request_id]
        start, n = item.start_position, item.num_tokens
        assert n >= 1 and start == req.num_computed_tokens
        assert out.num_scheduled_tokens[item.request_id] == n
        assert item.token_ids == req.all_token_ids[start : start + n]
        assert item.do_sample == (start + n == req.num_tokens)
        runner_tables = tables[item.request_id]
        held_tables = kv.get_block_ids(item.request_id)
        assert len(runner_tables) == len(held_tables) == len(cfg.kv_group_windows)
        for g, (table, held, w) in enumerate(zip(runner_tables, held_tables,
                                                 cfg.kv_group_windows, strict=True)):
            assert len(table) == len(held) == -(-(start + n) // bs)
            if w is not None:
                # Exactly the blocks wholly before the window of the step's first query are
                # freed (the runner keeps their ids, and reads none of them).
                freed = leading_nulls(held)
                assert freed == max(0, start - w + 1) // bs, (
                    f"{item.request_id}: group {g} (window {w}) freed {freed} blocks "
                    f"before position {start}")
                stats.freed_blocks = max(stats.freed_blocks, freed)
                stats.group_freed_blocks[g] = max(stats.group_freed_blocks[g], freed)
                held = table[:freed] + held[freed:]
            assert table == held, f"{item.request_id}: group {g}'s table {table} != {held}"
            # Blocks written this step belong to this request alone.
            for b in table[start // bs : (start + n - 1) // bs + 1]:
                assert b != NULL_BLOCK_ID and pool.blocks[b].ref_cnt == 1
        assert start + n <= cfg.max_model_len
        if not item.do_sample:
            stats.partial_prefills += 1
        if item.is_new and start > 0 and req.num_preemptions > 0:
            stats.resumed_with_hits += 1
        if item.is_new and req.num_preemptions == 0:
            stats.cache_hit_tokens += start
    stats.preemptions += len(out.preempted_req_ids)
    stats.max_batch = max(stats.max_batch, len(out.scheduled))


class Harness:
    """A scheduler driven by the fake runner, every step checked."""

    def __init__(self, cfg: SchedulerConfig) -> None:
        self.cfg = cfg
        self.sched = Scheduler(cfg)
        self.runner = FakeRunner(cfg)
        self.stats = RunStats()
        self.tokens: dict[str, list[int]] = {}
        self.results: dict[str, tuple[list[int], str, int | None]] = {}
        self.requests: dict[str, Request] = {}
        # Each prefix-cache key's blocks' fake KV, as first seen.
        self.cached_kv: dict[bytes, tuple] = {}
        # The runner's last tables of every request (kept after it finishes).
        self.last_tables: dict[str, list[list[int]]] = {}

    def add(self, spec: Spec) -> None:
        req = spec.make()
        self.requests[req.request_id] = req
        self.sched.add_request(req)
        self.tokens[req.request_id] = []

    def step(self) -> SchedulerOutput:
        sched, runner = self.sched, self.runner
        out = sched.schedule()
        runner.update_tables(out)
        check_step(sched, out, runner.tables, self.stats)
        for item in out.scheduled:
            self.last_tables[item.request_id] = [list(t) for t in
                                                 runner.tables[item.request_id]]
        for o in sched.update_from_output(out, runner.execute(out)):
            assert o.request_id not in self.results
            self.tokens[o.request_id] += o.new_token_ids
            if o.finished:
                self.results[o.request_id] = (self.tokens[o.request_id], o.finish_reason,
                                              o.stop_reason)
        check_pool(sched, runner, self.cached_kv)
        self.stats.steps += 1
        return out

    def drain(self, max_steps: int = 5000) -> None:
        while self.sched.has_unfinished_requests():
            self.step()
            assert self.stats.steps < max_steps, "no progress"

    def check_end(self) -> None:
        sched, cfg = self.sched, self.cfg
        assert sched.kv_cache_manager.num_free_blocks == cfg.num_blocks - 1
        assert sched.usage == 0.0 and not sched.requests
        for rid, (toks, reason, _) in self.results.items():
            req = self.requests[rid]
            assert req.output_token_ids == toks and req.finish_reason == reason


def run(
    cfg: SchedulerConfig, specs: list[Spec], max_steps: int = 5000
) -> tuple[dict[str, tuple[list[int], str, int | None]], RunStats]:
    h = Harness(cfg)
    pending = sorted(specs, key=lambda s: s.arrival_step)
    while pending or h.sched.has_unfinished_requests():
        while pending and pending[0].arrival_step <= h.stats.steps:
            h.add(pending.pop(0))
        h.step()
        assert h.stats.steps < max_steps, "no progress"
    h.check_end()
    return h.results, h.stats


def random_specs(seed: int, n: int, max_prompt: int) -> list[Spec]:
    rng = random.Random(seed)
    # A few shared "system prompts" so that prefix caching has something to hit.
    systems = [[rng.randrange(1, VOCAB) for _ in range(rng.randint(4, 12))] for _ in range(3)]
    specs = []
    for i in range(n):
        prompt = list(rng.choice(systems)) if rng.random() < 0.6 else []
        prompt += [rng.randrange(VOCAB) for _ in range(rng.randint(1, 12))]
        prompt = prompt[:max_prompt]
        max_tokens = rng.randint(1, 20)
        specs.append(
            Spec(
                rid=f"req{i}",
                prompt=prompt,
                max_tokens=max_tokens,
                min_tokens=rng.choice([0, 0, rng.randint(0, max_tokens)]),
                ignore_eos=rng.random() < 0.2,
                eos_token_id=rng.choice([EOS, EOS, None]),
                stop_token_ids=rng.sample(range(1, VOCAB), rng.choice([0, 0, 1, 3])),
                arrival_step=rng.choice([0, 0, rng.randint(0, 30)]),
            )
        )
    return specs


MML = 40
BASE = SchedulerConfig(
    max_num_seqs=64,
    max_num_batched_tokens=256,
    max_model_len=MML,
    block_size=4,
    num_blocks=400,
    enable_prefix_caching=True,
)
CONFIGS = {
    "ample": BASE,
    "no_prefix_cache": replace(BASE, enable_prefix_caching=False),
    # 10 usable blocks of 4 = exactly max_model_len: everything fits alone, not together.
    "small_pool": replace(BASE, num_blocks=11),
    "small_pool_no_cache": replace(BASE, num_blocks=11, enable_prefix_caching=False),
    "tiny_budget": replace(BASE, max_num_batched_tokens=3),
    "few_seqs": replace(BASE, max_num_seqs=2, block_size=3),
    "everything_tight": SchedulerConfig(
        max_num_seqs=3, max_num_batched_tokens=5, max_model_len=MML, block_size=2, num_blocks=21
    ),
}


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("name", list(CONFIGS))
def test_outputs_match_reference(name: str, seed: int) -> None:
    cfg = CONFIGS[name]
    specs = random_specs(seed, n=14, max_prompt=MML)
    results, stats = run(cfg, specs)
    assert results == {s.rid: reference(s, MML) for s in specs}
    if name.startswith("small_pool"):
        assert stats.preemptions > 0
    if name == "small_pool":
        assert stats.resumed_with_hits > 0
    if name in ("tiny_budget", "everything_tight"):
        assert stats.partial_prefills > 0
    if name == "ample":
        assert stats.cache_hit_tokens > 0 and stats.preemptions == 0
    if name == "few_seqs":
        assert stats.max_batch == 2


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    block_size=st.integers(1, 6),
    extra_blocks=st.integers(0, 30),
    budget=st.integers(1, 48),
    max_num_seqs=st.integers(1, 8),
    caching=st.booleans(),
)
def test_outputs_match_reference_random_configs(
    seed: int, block_size: int, extra_blocks: int, budget: int, max_num_seqs: int, caching: bool
) -> None:
    mml = 24
    cfg = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        max_model_len=mml,
        block_size=block_size,
        # Enough for any single request (max_model_len tokens), so none is unfittable.
        num_blocks=1 + -(-mml // block_size) + extra_blocks,
        enable_prefix_caching=caching,
    )
    specs = random_specs(seed, n=8, max_prompt=mml)
    results, _ = run(cfg, specs)
    assert results == {s.rid: reference(s, mml) for s in specs}


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    window=st.integers(1, 12),
    block_size=st.integers(1, 5),
    extra_blocks=st.integers(0, 20),
    budget=st.integers(1, 24),
    max_num_seqs=st.integers(1, 8),
    caching=st.booleans(),
)
def test_sliding_window_frees_blocks_behind_it(
    seed: int, window: int, block_size: int, extra_blocks: int, budget: int,
    max_num_seqs: int, caching: bool
) -> None:
    """A model that sees only its last `window` tokens: blocks behind every query's window go
    back to the pool, and the tokens are the windowed reference's (a block freed too early
    and reused changes them)."""
    mml = 40
    cfg = SchedulerConfig(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=mml,
        block_size=block_size, num_blocks=1 + -(-mml // block_size) + extra_blocks,
        enable_prefix_caching=caching, kv_group_windows=(window,),
    )
    specs = random_specs(seed, n=8, max_prompt=mml)
    results, stats = run(cfg, specs)
    assert results == {s.rid: reference(s, mml, (window,)) for s in specs}
    assert stats.freed_blocks > 0 or all(
        len(s.prompt) + s.max_tokens < window + block_size for s in specs)


def test_sliding_window_prefix_hit_needs_only_the_window() -> None:
    """The first blocks of a finished windowed prompt are evicted first (freed first); a later
    prompt sharing it still hits, since only the blocks in its first query's window count."""
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8, max_model_len=64,
                          block_size=4, num_blocks=13, kv_group_windows=(8,))
    rng = random.Random(5)
    shared = [rng.randrange(1, VOCAB) for _ in range(40)]
    specs = [Spec("a", shared, max_tokens=1),
             Spec("b", [rng.randrange(1, VOCAB) for _ in range(12)], max_tokens=4,
                  ignore_eos=True, arrival_step=10),
             Spec("c", shared + [1, 2, 3], max_tokens=5, ignore_eos=True, arrival_step=25)]
    results, stats = run(cfg, specs)
    assert results == {s.rid: reference(s, 64, (8,)) for s in specs}
    assert stats.cache_hit_tokens == 40  # all of c's full blocks of the shared prompt


def test_sliding_window_runs_past_the_pool() -> None:
    """A request longer than the whole KV pool finishes on its own max_tokens, not the pool's
    length: only its window's blocks are held."""
    cfg = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=8, max_model_len=200,
                          block_size=4, num_blocks=8, kv_group_windows=(9,))
    specs = [Spec("long", [5, 6, 7, 8, 9, 10], max_tokens=120, ignore_eos=True),
             Spec("other", [3, 4], max_tokens=40, ignore_eos=True, arrival_step=30)]
    results, stats = run(cfg, specs)
    assert results == {s.rid: reference(s, 200, (9,)) for s in specs}
    assert [len(results[s.rid][0]) for s in specs] == [120, 40]
    assert stats.freed_blocks >= 25


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    window=st.integers(1, 12),
    block_size=st.integers(1, 5),
    budget=st.integers(1, 16),
    prompt_len=st.integers(1, 90),
    caching=st.booleans(),
)
def test_a_windowed_prompt_needs_only_its_chunks_windows(
    seed: int, window: int, block_size: int, budget: int, prompt_len: int, caching: bool
) -> None:
    """In the smallest pool `prompt_blocks_needed` accepts, a windowed prompt, however much
    longer than the pool, is computed chunk by chunk to its first token, the windowed
    reference's; one block fewer is refused."""
    need = prompt_blocks_needed(prompt_len, block_size, (window,), budget)
    assert need <= -(-prompt_len // block_size)
    cfg = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=budget, max_model_len=200,
                          block_size=block_size, num_blocks=1 + need,
                          enable_prefix_caching=caching, kv_group_windows=(window,))
    rng = random.Random(seed)
    spec = Spec("p", [rng.randrange(1, VOCAB) for _ in range(prompt_len)], max_tokens=1,
                ignore_eos=True)
    results, _ = run(cfg, [spec])
    assert results == {"p": reference(spec, 200, (window,))}
    assert results["p"][1] == "length" and len(results["p"][0]) == 1
    if need > 1:
        smaller = Scheduler(replace(cfg, num_blocks=need))
        with pytest.raises(ValueError, match="KV blocks"):
            smaller.add_request(spec.make())


def test_requests_needing_no_adapter_slot_pass_a_head_waiting_for_one() -> None:
    """max_loras 1: a request with a second adapter waits for the first's requests to finish;
    a request without an adapter and one with the running adapter start past it, and no step
    runs two adapters."""
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=200,
                          block_size=4, num_blocks=64, max_loras=1)
    specs = [Spec("a", [1, 2, 3], max_tokens=30, ignore_eos=True, lora_int_id=1),
             Spec("b", [4, 5, 6], max_tokens=5, ignore_eos=True, lora_int_id=2),
             Spec("base", [7, 8], max_tokens=5, ignore_eos=True),
             Spec("a2", [9, 10], max_tokens=5, ignore_eos=True, lora_int_id=1)]
    sched = Scheduler(cfg)
    for spec in specs:
        sched.add_request(spec.make())
    first: dict[str, int] = {}
    lora_of = {s.rid: s.lora_int_id for s in specs}
    for step in range(200):
        if not sched.has_unfinished_requests():
            break
        out = sched.schedule()
        for item in out.scheduled:
            first.setdefault(item.request_id, step)
        assert len({lora_of[r.request_id] for r in sched.running} - {0}) <= 1
        sched.update_from_output(out, {i.request_id: [7] for i in out.scheduled
                                       if i.do_sample})
    assert not sched.has_unfinished_requests()
    assert first["a"] == first["base"] == first["a2"] == 0
    assert first["b"] >= 30  # after a's 30 tokens


# ---- stop conditions, with the sampled tokens scripted ------------------------------------


def drive(sched: Scheduler, script: dict[str, list[int]], max_steps: int = 200) -> dict:
    """Feed each request the next token of its script whenever it samples."""
    got: dict[str, list[int]] = {rid: [] for rid in script}
    finals = {}
    cursor = dict.fromkeys(script, 0)
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            break
        out = sched.schedule()
        sampled = {}
        for item in out.scheduled:
            if item.do_sample:
                rid = item.request_id
                sampled[rid] = [script[rid][cursor[rid]]]
                cursor[rid] += 1
        for o in sched.update_from_output(out, sampled):
            got[o.request_id] += o.new_token_ids
            if o.finished:
                finals[o.request_id] = (got[o.request_id], o.finish_reason, o.stop_reason)
    assert not sched.has_unfinished_requests()
    return finals


def one(script: list[int], max_model_len: int = 64, prompt_len: int = 5, **kw) -> tuple:
    sched = Scheduler(SchedulerConfig(max_model_len=max_model_len, block_size=4, num_blocks=64))
    sched.add_request(Request("r", list(range(1, prompt_len + 1)), **kw))
    return drive(sched, {"r": script})["r"]


def test_eos_stops_and_is_kept() -> None:
    assert one([5, 6, EOS, 7], eos_token_id=EOS) == ([5, 6, EOS], "stop", None)


def test_no_eos_token_id_means_no_eos_stop() -> None:
    assert one([EOS, EOS, EOS], max_tokens=3, eos_token_id=None) == ([EOS] * 3, "length", None)


def test_ignore_eos() -> None:
    assert one([EOS] * 10, max_tokens=4, eos_token_id=EOS, ignore_eos=True) == (
        [EOS] * 4,
        "length",
        None,
    )


def test_stop_token_ids_set_stop_reason() -> None:
    assert one([1, 9, 2], stop_token_ids=[8, 9], eos_token_id=EOS) == ([1, 9], "stop", 9)


def test_ignore_eos_keeps_stop_token_ids() -> None:
    assert one([EOS, 9], eos_token_id=EOS, ignore_eos=True, stop_token_ids=[9]) == (
        [EOS, 9],
        "stop",
        9,
    )


def test_min_tokens_hides_stop_tokens() -> None:
    script = [EOS, 9, EOS, EOS]
    assert one(script, min_tokens=3, eos_token_id=EOS, stop_token_ids=[9]) == (
        [EOS, 9, EOS],
        "stop",
        None,
    )
    assert one([9, 9, 9, 9], min_tokens=2, stop_token_ids=[9]) == ([9, 9], "stop", 9)


def test_max_tokens() -> None:
    assert one([1, 2, 3, 4, 5], max_tokens=3) == ([1, 2, 3], "length", None)
    # A stop token on the last allowed step reports "stop".
    assert one([1, 2, 9], max_tokens=3, stop_token_ids=[9]) == ([1, 2, 9], "stop", 9)


def test_max_model_len() -> None:
    assert one(list(range(10, 30)), max_model_len=12, prompt_len=10) == ([10, 11], "length", None)
    # A prompt of exactly max_model_len still yields its one token.
    assert one([7, 8], max_model_len=12, prompt_len=12) == ([7], "length", None)


def test_add_request_validation() -> None:
    sched = Scheduler(SchedulerConfig(max_model_len=16, block_size=4, num_blocks=4))
    with pytest.raises(ValueError, match="max_model_len"):
        sched.add_request(Request("a", [1] * 17))
    with pytest.raises(ValueError, match="KV blocks"):
        sched.add_request(Request("b", [1] * 13))  # 4 blocks, 3 usable
    sched.add_request(Request("c", [1] * 12))
    with pytest.raises(ValueError, match="already"):
        sched.add_request(Request("c", [1]))
    with pytest.raises(ValueError):
        Request("d", [])
    with pytest.raises(ValueError):
        Request("e", [1], max_tokens=2, min_tokens=3)
    with pytest.raises(ValueError):
        SchedulerConfig(num_blocks=1)


def test_request_that_outgrows_the_cache_alone_is_length_capped() -> None:
    # 3 usable blocks of 4 = 12 KV slots, far below max_model_len.
    cfg = SchedulerConfig(max_model_len=100, block_size=4, num_blocks=4, max_num_batched_tokens=64)
    sched = Scheduler(cfg)
    sched.add_request(Request("r", list(range(1, 9)), max_tokens=50))
    finals = drive(sched, {"r": list(range(20, 70))})
    # Positions 0..11 computed: 8 prompt tokens + 4 generated computed + 1 generated pending.
    assert finals["r"] == ([20, 21, 22, 23, 24], "length", None)
    assert sched.kv_cache_manager.num_free_blocks == 3


def test_two_requests_outgrowing_the_cache_do_not_deadlock() -> None:
    cfg = SchedulerConfig(max_model_len=100, block_size=4, num_blocks=4, max_num_batched_tokens=64)
    sched = Scheduler(cfg)
    sched.add_request(Request("a", list(range(1, 9)), max_tokens=50))
    sched.add_request(Request("b", list(range(1, 5)), max_tokens=50))
    finals = drive(sched, {"a": list(range(100, 150)), "b": list(range(200, 250))})
    assert {r: f[1] for r, f in finals.items()} == {"a": "length", "b": "length"}
    assert len(finals["a"][0]) == 5 and len(finals["b"][0]) == 9
    assert sched.num_preemptions > 0
    assert sched.kv_cache_manager.num_free_blocks == 3


# ---- scheduling policy ---------------------------------------------------------------------


def step(sched: Scheduler, out: SchedulerOutput, token: int = 1) -> list:
    return sched.update_from_output(
        out, {i.request_id: [token] for i in out.scheduled if i.do_sample}
    )


def test_budget_goes_to_running_first_then_chunks_new_prompt() -> None:
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=8, block_size=4, num_blocks=64))
    sched.add_request(Request("a", [1, 2, 3]))
    sched.add_request(Request("b", [4, 5]))
    out = sched.schedule()
    assert [(i.request_id, i.num_tokens, i.do_sample) for i in out.scheduled] == [
        ("a", 3, True),
        ("b", 2, True),
    ]
    step(sched, out)
    sched.add_request(Request("c", list(range(10, 30))))
    out = sched.schedule()
    assert [(i.request_id, i.start_position, i.num_tokens, i.do_sample) for i in out.scheduled] == [
        ("a", 3, 1, True),
        ("b", 2, 1, True),
        ("c", 0, 6, False),
    ]
    assert out.scheduled[2].is_new and not out.scheduled[0].is_new
    assert out.num_cached_tokens == {"c": 0}
    step(sched, out)
    out = sched.schedule()
    # c continues its prefill as a running request.
    assert [(i.request_id, i.start_position, i.num_tokens) for i in out.scheduled] == [
        ("a", 4, 1),
        ("b", 3, 1),
        ("c", 6, 6),
    ]
    assert not any(i.is_new for i in out.scheduled)


def test_max_num_seqs_and_fcfs() -> None:
    sched = Scheduler(SchedulerConfig(max_num_seqs=2, block_size=4, num_blocks=64))
    for r in "abcd":
        sched.add_request(Request(r, [1, 2], max_tokens=2))
    out = sched.schedule()
    assert [i.request_id for i in out.scheduled] == ["a", "b"]
    assert sched.get_num_unfinished_requests() == 4
    step(sched, out)
    out = sched.schedule()
    assert [i.request_id for i in out.scheduled] == ["a", "b"]
    step(sched, out)  # a and b reach max_tokens
    out = sched.schedule()
    assert out.finished_req_ids == ["a", "b"]
    assert [i.request_id for i in out.scheduled] == ["c", "d"]
    assert sched.get_num_unfinished_requests() == 2


def test_preemption_picks_latest_arrival_and_resumes_with_prefix_hits() -> None:
    # 6 usable blocks of 4. Each request grows to 8 + 12 - 1 = 19 computed tokens = 5 blocks.
    cfg = SchedulerConfig(max_model_len=64, block_size=4, num_blocks=7)
    sched = Scheduler(cfg)
    sched.add_request(Request("a", [1] * 8, max_tokens=12))
    sched.add_request(Request("b", [2] * 8, max_tokens=12))
    preempted, resumed = [], []
    while sched.has_unfinished_requests():
        out = sched.schedule()
        preempted += out.preempted_req_ids
        resumed += [(i.request_id, i.start_position) for i in out.scheduled if i.is_new]
        step(sched, out, token=3)
    assert preempted == ["b"]
    # b held 3 full cached blocks when preempted; a then took 2 more blocks, evicting b's
    # (freed tail first) last two, so b comes back with its first block found in the cache.
    assert resumed == [("a", 0), ("b", 0), ("b", 4)]
    assert sched.kv_cache_manager.num_free_blocks == 6


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_preempted_request_waits_until_its_whole_sequence_fits(prefix_caching: bool) -> None:
    # Three requests grow in step to 31 computed tokens (8 blocks of 4) in 17 usable blocks:
    # two fit, the third is preempted. Its recompute runs in chunks of 8 tokens; taken back
    # when only its first chunk fits, it runs out again before catching up, is preempted
    # again (it is the latest), and starts over, step after step, while nothing finishes.
    cfg = SchedulerConfig(max_model_len=64, block_size=4, num_blocks=18,
                          max_num_batched_tokens=8, enable_prefix_caching=prefix_caching)
    specs = [Spec(rid, [t] * 8, max_tokens=24, ignore_eos=True)
             for rid, t in (("a", 1), ("b", 2), ("c", 3))]
    h = Harness(cfg)
    for spec in specs:
        h.add(spec)
    events: list[tuple[str, str]] = []
    while h.sched.has_unfinished_requests():
        out = h.step()
        events += [("preempted", rid) for rid in out.preempted_req_ids]
        events += [("finished", rid) for rid in h.results if ("finished", rid) not in events]
        assert h.stats.steps < 500
    h.check_end()
    assert {rid: h.results[rid] for rid in "abc"} == {
        spec.rid: reference(spec, cfg.max_model_len) for spec in specs}
    preempted = [rid for kind, rid in events if kind == "preempted"]
    assert preempted, "the pool is meant to run out"
    # Between two preemptions of one request, another request finished.
    for rid in set(preempted):
        since_last = None
        for kind, other in events:
            if kind == "preempted" and other == rid:
                assert since_last in (None, True), f"{rid} preempted again before any finish"
                since_last = False
            elif kind == "finished":
                since_last = True


def test_free_blocks_to_hold_a_whole_sequence() -> None:
    kv = KVCacheManager(num_blocks=32, block_size=4)
    a = Request("a", list(range(12)))
    assert kv.allocate_slots(a, 12) is not None
    kv.cache_blocks(a, 12)
    b = Request("b", list(range(12)) + [50, 51, 52, 53, 54])  # 17 tokens: 5 blocks
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 12
    # a holds the three hit blocks: b needs two more from the free queue.
    assert kv.num_free_blocks_to_hold(b, hits, max_chunk=8) == 2
    kv.free(a)
    hits, _ = kv.get_computed_blocks(b)
    # Free cached blocks leave the free queue when hit: all five count.
    assert kv.num_free_blocks_to_hold(b, hits, max_chunk=8) == 5
    # A full and a sliding group (window 8): the full one holds all 10 blocks of 40 tokens,
    # the sliding one those under one 8-token chunk's windows: (8 - 1 + 8) / 4 -> 4, + 1.
    kv = KVCacheManager(num_blocks=64, block_size=4, group_windows=(None, 8))
    c = Request("c", list(range(100, 140)))
    assert kv.num_free_blocks_to_hold(c, kv.get_computed_blocks(c)[0], max_chunk=8) == 15


def test_prefix_cache_hits_reported() -> None:
    sched = Scheduler(SchedulerConfig(block_size=4, num_blocks=64))
    sched.add_request(Request("a", list(range(1, 11)), max_tokens=1))
    step(sched, sched.schedule())
    sched.add_request(Request("b", list(range(1, 11)) + [5], max_tokens=1))
    out = sched.schedule()
    assert out.num_cached_tokens == {"b": 8}
    assert out.scheduled[0].start_position == 8 and out.scheduled[0].token_ids == [9, 10, 5]
    (o,) = step(sched, out)
    assert o.num_cached_tokens == 8 and o.finish_reason == "length"


# ---- aborts --------------------------------------------------------------------------------


def test_abort_mid_prefill() -> None:
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=4, block_size=4, num_blocks=16))
    sched.add_request(Request("a", list(range(1, 20))))
    out = sched.schedule()
    assert not out.scheduled[0].do_sample
    step(sched, out)
    assert sched.kv_cache_manager.num_free_blocks < 15
    sched.abort_requests("a")
    assert sched.kv_cache_manager.num_free_blocks == 15
    assert not sched.has_unfinished_requests()
    out = sched.schedule()
    assert out.finished_req_ids == ["a"] and out.is_empty
    assert sched.schedule().finished_req_ids == []


def test_abort_mid_decode_and_waiting() -> None:
    sched = Scheduler(SchedulerConfig(max_num_seqs=1, block_size=4, num_blocks=16))
    a, b = Request("a", [1, 2, 3]), Request("b", [4, 5])
    sched.add_request(a)
    sched.add_request(b)
    for _ in range(3):
        step(sched, sched.schedule())
    assert a.num_output_tokens == 3 and a.status == RequestStatus.RUNNING
    sched.abort_requests(["a", "b", "unknown"])
    assert a.status == b.status == RequestStatus.FINISHED_ABORTED
    assert a.finish_reason == "abort"
    assert sched.kv_cache_manager.num_free_blocks == 15
    assert sched.schedule().finished_req_ids == ["a", "b"]


def test_block_and_request_counts() -> None:
    """What the engine reports (free / usable blocks, running / waiting requests) comes from
    the scheduler itself."""
    sched = Scheduler(SchedulerConfig(max_num_seqs=1, block_size=4, num_blocks=16))
    assert (sched.num_free_blocks, sched.num_usable_blocks) == (15, 15)
    assert sched.get_request_counts() == (0, 0)
    sched.add_request(Request("a", [1, 2, 3, 4, 5]))
    sched.add_request(Request("b", [4, 5]))
    assert sched.get_request_counts() == (0, 2)
    step(sched, sched.schedule())
    assert sched.get_request_counts() == (1, 1)
    assert (sched.num_free_blocks, sched.num_usable_blocks) == (13, 15)
    sched.abort_requests(["a", "b"])
    assert sched.get_request_counts() == (0, 0) and sched.num_free_blocks == 15


def test_abort_between_schedule_and_update() -> None:
    sched = Scheduler(SchedulerConfig(block_size=4, num_blocks=16))
    sched.add_request(Request("a", [1, 2, 3]))
    sched.add_request(Request("b", [1, 2, 3]))
    out = sched.schedule()
    sched.abort_requests("a")
    outputs = step(sched, out)
    assert [o.request_id for o in outputs] == ["b"]
    sched.abort_requests("b")
    assert sched.kv_cache_manager.num_free_blocks == 15


def test_finish_from_outside_with_stop_status() -> None:
    sched = Scheduler(SchedulerConfig(block_size=4, num_blocks=16))
    r = Request("a", [1, 2, 3])
    sched.add_request(r)
    step(sched, sched.schedule())
    sched.finish_requests("a", RequestStatus.FINISHED_STOPPED)
    assert r.finish_reason == "stop" and not sched.has_unfinished_requests()
    with pytest.raises(ValueError):
        sched.finish_requests("a", RequestStatus.RUNNING)


def test_finish_after_ends_a_request_with_its_tokens_unless_a_stop_comes_first() -> None:
    """A status the engine decided before the update (a grammar complete, or refusing a
    token) ends the request once its tokens are in; its own stop, on those tokens, wins."""
    sched = Scheduler(SchedulerConfig(block_size=4, num_blocks=16))
    for rid in "abc":
        sched.add_request(Request(rid, [1, 2, 3], eos_token_id=EOS, max_tokens=8))
    out = sched.schedule()
    results = sched.update_from_output(
        out, {"a": [5], "b": [EOS], "c": [6]},
        {"a": FinishAfter(RequestStatus.FINISHED_STOPPED, None),
         "b": FinishAfter(RequestStatus.FINISHED_ERROR, "refused")})
    got = {r.request_id: (r.new_token_ids, r.finish_reason, r.stop_reason) for r in results}
    assert got == {"a": ([5], "stop", None), "b": ([EOS], "stop", None), "c": ([6], None, None)}
    out = sched.schedule()
    assert sorted(out.finished_req_ids) == ["a", "b"]
    (result,) = sched.update_from_output(out, {"c": [7]},
                                         {"c": FinishAfter(RequestStatus.FINISHED_ERROR,
                                                           "refused")})
    assert (result.new_token_ids, result.finish_reason, result.stop_reason) == (
        [7], "error", "refused")
    assert not sched.has_unfinished_requests() and sched.num_free_blocks == 15
    sched.add_request(Request("d", [1, 2, 3]))
    out = sched.schedule()
    with pytest.raises(ValueError, match="not a finished status"):
        sched.update_from_output(out, {"d": [5]}, {"d": FinishAfter(RequestStatus.RUNNING)})


def test_protocol_errors() -> None:
    sched = Scheduler(SchedulerConfig(block_size=4, num_blocks=16))
    sched.add_request(Request("a", [1, 2, 3]))
    out = sched.schedule()
    with pytest.raises(ValueError, match="no sampled token"):
        sched.update_from_output(out, {})
    sched = Scheduler(SchedulerConfig(block_size=4, num_blocks=16))
    sched.add_request(Request("a", [1, 2, 3]))
    out = sched.schedule()
    step(sched, out)
    with pytest.raises(RuntimeError, match="twice"):
        step(sched, out)


def test_empty_schedule() -> None:
    sched = Scheduler(SchedulerConfig())
    out = sched.schedule()
    assert out.is_empty and out.scheduled == []
    assert sched.update_from_output(out, {}) == []


def _decode_with_drafts(sched: Scheduler, rid: str, drafts: list[int]):
    sched.update_draft_token_ids({rid: drafts})
    return sched.schedule()


def test_update_draft_token_ids_feeds_the_next_schedule_and_counts_verification() -> None:
    sched = Scheduler(SchedulerConfig(block_size=4, num_blocks=16))
    sched.add_request(Request("a", [1, 2, 3], max_tokens=10))
    sched.update_from_output(sched.schedule(), {"a": [4]})
    # Ids no longer here (finished, aborted, never seen) are ignored.
    sched.update_draft_token_ids({"a": [5, 6], "gone": [7]})
    out = sched.schedule()
    (item,) = out.scheduled
    assert (item.token_ids, item.num_draft_tokens) == ([4, 5, 6], 2)
    sched.update_from_output(out, {"a": [5, 8]})
    assert (sched.num_spec_drafts, sched.num_spec_draft_tokens,
            sched.num_spec_accepted_tokens) == (1, 2, 1)
    # A step's drafts are used once: the next schedule without new ones verifies none.
    (item,) = sched.schedule().scheduled
    assert item.num_draft_tokens == 0


def test_several_sampled_tokens_stop_at_the_first_stop() -> None:
    sched = Scheduler(SchedulerConfig(block_size=4, num_blocks=16))
    sched.add_request(Request("a", [1, 2, 3], stop_token_ids=[9], max_tokens=10))
    sched.update_from_output(sched.schedule(), {"a": [4]})
    out = _decode_with_drafts(sched, "a", [9, 5])
    (item,) = out.scheduled
    assert (item.token_ids, item.num_draft_tokens, item.do_sample) == ([4, 9, 5], 2, True)
    (o,) = sched.update_from_output(out, {"a": [9, 5, 7]})
    assert (o.new_token_ids, o.finish_reason, o.stop_reason) == ([9], "stop", 9)
    assert sched.kv_cache_manager.block_pool.num_free_blocks == 15


def test_finish_after_some_tokens_keeps_those_and_counts_every_verified_draft() -> None:
    """The engine may end a request partway through its accepted drafts (a grammar complete
    at the second token): the tokens up to there are kept, and acceptance counts every draft
    the model verified, as a stop among them does."""
    sched = Scheduler(SchedulerConfig(block_size=4, num_blocks=16))
    sched.add_request(Request("a", [1, 2, 3], max_tokens=10))
    sched.update_from_output(sched.schedule(), {"a": [4]})
    out = _decode_with_drafts(sched, "a", [5, 6, 7])
    (o,) = sched.update_from_output(out, {"a": [5, 6, 7, 8]},
                                    {"a": FinishAfter(RequestStatus.FINISHED_STOPPED, None, 2)})
    assert (o.new_token_ids, o.finish_reason, o.num_draft_tokens, o.num_accepted_tokens) == (
        [5, 6], "stop", 3, 3)
    assert sched.num_spec_accepted_tokens == 3 and not sched.has_unfinished_requests()
    assert sched.num_free_blocks == 15


def test_drafts_accepted_and_rejected_advance_computed_tokens() -> None:
    sched = Scheduler(SchedulerConfig(block_size=4, num_blocks=16))
    sched.add_request(Request("b", [1, 2, 3], max_tokens=10))
    sched.update_from_output(sched.schedule(), {"b": [4]})
    out = _decode_with_drafts(sched, "b", [5, 6, 7, 8, 10])
    assert out.scheduled[0].num_draft_tokens == 5
    assert len(sched.kv_cache_manager.get_block_ids("b")[0]) == 3  # positions 0..8
    free = sched.kv_cache_manager.block_pool.num_free_blocks
    (o,) = sched.update_from_output(out, {"b": [5, 9]})  # draft 5 accepted, 6 rejected
    assert (o.new_token_ids, o.num_draft_tokens, o.num_accepted_tokens) == ([5, 9], 5, 1)
    req = sched.requests["b"]
    assert req.num_computed_tokens == 5 and req.all_token_ids == [1, 2, 3, 4, 5, 9]
    # Positions 0..5 need two blocks: the third goes back, and the runner learns it.
    assert len(sched.kv_cache_manager.get_block_ids("b")[0]) == 2
    assert sched.kv_cache_manager.block_pool.num_free_blocks == free + 1
    out = sched.schedule()
    (item,) = out.scheduled
    assert (item.start_position, item.token_ids, item.num_draft_tokens) == (5, [9], 0)
    assert out.truncated_block_tables == {"b": 2}
    sched.update_from_output(out, {"b": [11]})
    assert sched.schedule().truncated_block_tables == {}


def test_blocks_filled_by_accepted_drafts_are_cached_with_their_tokens() -> None:
    """A block completed by accepted drafts is registered under the hash of its own tokens,
    so a later prompt that starts with them hits it (and the blocks after it)."""
    sched = Scheduler(SchedulerConfig(block_size=4, num_blocks=16))
    sched.add_request(Request("f", [1, 2, 3], max_tokens=30))
    sched.update_from_output(sched.schedule(), {"f": [4]})
    out = _decode_with_drafts(sched, "f", [5, 6, 7, 8, 10])
    sched.update_from_output(out, {"f": [5, 6, 7, 8, 10, 11]})  # all accepted, then 11
    req = sched.requests["f"]
    assert req.num_computed_tokens == 9
    assert req.all_token_ids == [1, 2, 3, 4, 5, 6, 7, 8, 10, 11]
    first = hash_block_tokens(None, [1, 2, 3, 4])
    # The block the accepted drafts filled is registered at once, under its own tokens.
    assert req.block_hashes == [first, hash_block_tokens(first, [5, 6, 7, 8])]
    sched.update_from_output(sched.schedule(), {"f": [13]})
    sched.add_request(Request("g", [1, 2, 3, 4, 5, 6, 7, 8, 10, 12], max_tokens=2))
    out = sched.schedule()
    (item,) = [r for r in out.scheduled if r.request_id == "g"]
    assert item.start_position == 8  # two cached blocks


def test_requests_whose_drafts_fill_blocks_never_share_their_hashes() -> None:
    """Two requests with the same prompt whose accepted drafts differ: a lookup of one's tokens
    hits its own blocks, never the other's (whose KV holds other tokens)."""
    sched = Scheduler(SchedulerConfig(block_size=4, num_blocks=32))
    for rid in ("a", "b"):
        sched.add_request(Request(rid, [1, 2, 3], max_tokens=30))
    sched.update_from_output(sched.schedule(), {"a": [4], "b": [4]})
    sched.requests["a"].spec_token_ids = [5, 6, 7, 8, 10]
    sched.requests["b"].spec_token_ids = [20, 21, 22, 23, 24]
    sched.update_from_output(sched.schedule(), {"a": [5, 6, 7, 8, 10, 11],
                                                "b": [20, 21, 22, 23, 24, 25]})
    sched.update_from_output(sched.schedule(), {"a": [12], "b": [26]})
    kv = sched.kv_cache_manager
    a, b = sched.requests["a"], sched.requests["b"]
    assert a.block_hashes[1] != b.block_hashes[1]
    hits, num_hit = kv.get_computed_blocks(Request("c", a.all_token_ids, max_tokens=2))
    assert num_hit == 8 and hits[0][1].block_id == kv.get_block_ids("a")[0][1]
    hits, num_hit = kv.get_computed_blocks(Request("d", b.all_token_ids, max_tokens=2))
    assert num_hit == 8 and hits[0][1].block_id == kv.get_block_ids("b")[0][1]


def test_drafts_capped_by_max_tokens_and_budget() -> None:
    sched = Scheduler(SchedulerConfig(block_size=4, num_blocks=16, max_num_batched_tokens=8))
    sched.add_request(Request("c", [1, 2, 3], max_tokens=3))
    sched.update_from_output(sched.schedule(), {"c": [4]})
    # Two tokens left: at most one draft and the token after it.
    out = _decode_with_drafts(sched, "c", [5, 6, 7])
    assert out.scheduled[0].token_ids == [4, 5]
    (o,) = sched.update_from_output(out, {"c": [5, 6]})
    assert (o.new_token_ids, o.finish_reason) == ([5, 6], "length")
    sched.add_request(Request("d", [1, 2, 3], max_tokens=30))
    sched.update_from_output(sched.schedule(), {"d": [4]})
    out = _decode_with_drafts(sched, "d", list(range(10, 20)))
    assert out.scheduled[0].token_ids == [4] + list(range(10, 17))  # the budget of 8


def _decode_all_rejected(sched: Scheduler, rids: list[str], drafts: bool,
                         steps: int = 12) -> tuple[dict[str, list[int]], dict[str, str]]:
    """Decode steps in which every draft is rejected (each request gets one token per step,
    as without drafts): the tokens and finish reasons."""
    tokens: dict[str, list[int]] = {rid: [] for rid in rids}
    reasons: dict[str, str] = {}
    for step in range(steps):
        for rid in rids:
            if drafts and rid in sched.requests:
                sched.requests[rid].spec_token_ids = [50, 51, 52]
        out = sched.schedule()
        results = sched.update_from_output(
            out, {r.request_id: [60 + step] for r in out.scheduled if r.do_sample})
        for r in results:
            tokens[r.request_id] += r.new_token_ids
            if r.finish_reason is not None:
                reasons[r.request_id] = r.finish_reason
        if not sched.has_unfinished_requests():
            break
    return tokens, reasons


@pytest.mark.parametrize("drafts", [False, True])
def test_drafts_that_do_not_fit_the_kv_cache_are_dropped(drafts: bool) -> None:
    """A request alone whose next token fits the KV cache but whose drafts do not: the drafts
    go, the request goes on (it ends only when its own tokens no longer fit), exactly as
    without drafts."""
    sched = Scheduler(SchedulerConfig(block_size=4, num_blocks=3))  # 8 token slots
    sched.add_request(Request("a", [1, 2, 3], max_tokens=20))
    sched.update_from_output(sched.schedule(), {"a": [4]})
    tokens, reasons = _decode_all_rejected(sched, ["a"], drafts)
    assert tokens["a"] == [60, 61, 62, 63, 64] and reasons == {"a": "length"}
    assert sched.kv_cache_manager.block_pool.num_free_blocks == 2


def test_drafts_never_preempt_a_request() -> None:
    """Two requests fill the 4 usable blocks with positions 0..7 each; a third step's drafts
    would need a fifth block: they are dropped instead of preempting the other request."""
    sched = Scheduler(SchedulerConfig(block_size=4, num_blocks=5))
    for rid in ("a", "b"):
        sched.add_request(Request(rid, [1, 2, 3], max_tokens=20))
    sched.update_from_output(sched.schedule(), {"a": [4], "b": [4]})
    tokens, reasons = _decode_all_rejected(sched, ["a", "b"], drafts=True, steps=3)
    assert sched.num_preemptions == 0 and not reasons
    assert tokens == {"a": [60, 61, 62], "b": [60, 61, 62]}
    assert sched.kv_cache_manager.block_pool.num_free_blocks == 0


def test_drafts_only_follow_a_decode_token() -> None:
    sched = Scheduler(SchedulerConfig(block_size=4, num_blocks=16, max_num_batched_tokens=4))
    sched.add_request(Request("e", [1, 2, 3, 4, 5, 6], max_tokens=10))
    sched.update_from_output(sched.schedule(), {})  # the first chunk of 4
    sched.requests["e"].spec_token_ids = [7, 8]
    out = sched.schedule()  # the last chunk: drafts dropped
    assert out.scheduled[0].token_ids == [5, 6] and out.scheduled[0].num_draft_tokens == 0
    assert not sched.requests["e"].spec_token_ids


def test_scheduler_output_pickles() -> None:
    sched = Scheduler(SchedulerConfig(block_size=4, num_blocks=16))
    sched.add_request(Request("a", [1, 2, 3, 4, 5], sampling_params={"temperature": 0.0}))
    out = sched.schedule()
    assert pickle.loads(pickle.dumps(out)) == out
    assert out.scheduled[0].sampling_params == {"temperature": 0.0}



def test_sliding_window_async_waits_for_the_step_in_flight() -> None:
    """Async scheduling in a pool that holds little more than the window: the blocks the step
    in flight leaves behind its window are freed once it lands, so a request that finds the
    pool full meanwhile waits a step instead of ending early."""
    # 3 usable blocks of 2: a step for position q holds q - 4 .. q, which fits; one scheduled
    # for q + 1 while q's is in flight holds q - 4 .. q + 1 until q's step lands: 4 blocks.
    cfg = SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=4, max_model_len=200,
                          block_size=2, num_blocks=4, kv_group_windows=(5,))
    sched = Scheduler(cfg)
    sched.add_request(Request("r", [3, 4, 5, 6], max_tokens=60, ignore_eos=True))
    tokens: list[int] = []
    finished = None
    prev = sched.schedule()
    for _ in range(400):
        out = sched.schedule()  # the next step, scheduled while `prev` runs
        sampled = {i.request_id: [7] for i in prev.scheduled if i.do_sample}
        for o in sched.update_from_output(prev, sampled):
            tokens += o.new_token_ids
            if o.finished:
                finished = o.finish_reason
        prev = out
        if finished is not None:
            break
    assert (finished, len(tokens)) == ("length", 60)
    assert sched.kv_cache_manager.num_free_blocks == cfg.num_blocks - 1


# ---- several KV cache groups (hybrid models: full attention and sliding windows) ---------


WINDOW = st.integers(1, 12)
# Gemma-like patterns first ((None, W), (None, W, W, W), (W, None)), then any mix of 2-4.
GROUP_WINDOWS = st.one_of(
    st.builds(lambda w, k: (None,) + (w,) * k, WINDOW, st.sampled_from([1, 3])),
    st.builds(lambda w: (w, None), WINDOW),
    st.lists(st.one_of(st.none(), WINDOW), min_size=2, max_size=4).map(tuple),
)


def hybrid_config(windows: tuple[int | None, ...], mml: int, block_size: int, budget: int,
                  extra_blocks: int, **kw) -> SchedulerConfig:
    """A pool that holds any one request of max_model_len tokens (what prompt_blocks_needed
    asks for one), and `extra_blocks` more."""
    need = prompt_blocks_needed(mml, block_size, windows, budget)
    return SchedulerConfig(max_model_len=mml, block_size=block_size,
                           max_num_batched_tokens=budget, num_blocks=1 + need + extra_blocks,
                           kv_group_windows=windows, **kw)


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    windows=GROUP_WINDOWS,
    block_size=st.integers(1, 5),
    extra_blocks=st.integers(0, 24),
    budget=st.integers(1, 24),
    max_num_seqs=st.integers(1, 8),
    caching=st.booleans(),
)
def test_hybrid_groups_match_the_reference_and_free_behind_their_windows(
    seed: int, windows: tuple[int | None, ...], block_size: int, extra_blocks: int,
    budget: int, max_num_seqs: int, caching: bool
) -> None:
    """Full-attention and sliding-window groups from one pool: the tokens are the reference's
    (every group read its own KV of the right positions), the invariants hold every step over
    all groups, every sliding group frees the blocks behind its windows, and all blocks come
    back."""
    mml = 40
    cfg = hybrid_config(windows, mml, block_size, budget, extra_blocks,
                        max_num_seqs=max_num_seqs, enable_prefix_caching=caching)
    specs = random_specs(seed, n=8, max_prompt=mml)
    results, stats = run(cfg, specs)
    assert results == {s.rid: reference(s, mml, windows) for s in specs}
    for g, w in enumerate(windows):
        # A decode step at position s frees the first block once s - w + 1 >= block_size.
        decoded_past = any(len(out) >= 2 and len(s.prompt) + len(out) - 2 >= w - 1 + block_size
                           for s in specs for out in [results[s.rid][0]]) if w else False
        if w is None:
            assert stats.group_freed_blocks[g] == 0
        elif decoded_past:
            assert stats.group_freed_blocks[g] > 0


def test_hybrid_sliding_groups_run_past_what_a_full_group_would_hold() -> None:
    """(None, W, W, W): a long request holds its full group's blocks and only its windows'
    in the three sliding groups, so a pool far smaller than four full tables runs it."""
    cfg = hybrid_config((None, 9, 9, 9), mml=120, block_size=4, budget=8, extra_blocks=2,
                        max_num_seqs=2)
    # 30 blocks of the full group, 5 of each sliding group (a chunk of 8 and the 8 positions
    # before it), 2 more.
    assert cfg.num_blocks == 1 + 30 + 3 * 5 + 2
    specs = [Spec("long", [5, 6, 7, 8, 9, 10], max_tokens=110, ignore_eos=True),
             Spec("other", [3, 4], max_tokens=10, ignore_eos=True, arrival_step=50)]
    results, stats = run(cfg, specs)
    assert results == {s.rid: reference(s, 120, cfg.kv_group_windows) for s in specs}
    assert [len(results[s.rid][0]) for s in specs] == [110, 10]
    # The last step computes position 6 + 110 - 2 = 114: its window starts at 106, in
    # block 26.
    assert stats.group_freed_blocks == {1: 26, 2: 26, 3: 26}


def assert_hits_hold_group_kv(h: Harness, hits: tuple[list, ...], tokens: list[int]) -> None:
    """Each group's hit blocks hold that group's KV of the prompt's tokens there (a sliding
    group's leading null blocks aside)."""
    bs = h.cfg.block_size
    for g, blocks in enumerate(hits):
        for i, blk in enumerate(blocks):
            if blk.block_id != NULL_BLOCK_ID:
                assert h.runner.kv[blk.block_id] == [(g, t) for t in tokens[i * bs:(i + 1) * bs]]


@pytest.mark.parametrize("windows", [(None, None), (None, 6), (6, None), (None, 5, 5, 5),
                                     (3, None, 7)])
def test_a_shared_prefix_hits_in_every_group(windows: tuple[int | None, ...]) -> None:
    """A prompt sharing a finished one's first 24 tokens hits those 6 blocks in every group:
    a full group all of them, a sliding group those under its first query's window (null
    blocks before), each the block the first request's same group computed them in."""
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8, max_model_len=64,
                          block_size=4, num_blocks=64, kv_group_windows=windows)
    rng = random.Random(3)
    shared = [rng.randrange(1, VOCAB) for _ in range(30)]
    a = Spec("a", shared, max_tokens=2, ignore_eos=True)
    b = Spec("b", shared[:24] + [1, 2, 3, 4, 5], max_tokens=3, ignore_eos=True)
    h = Harness(cfg)
    h.add(a)
    h.drain()
    req = b.make()
    hits, num_hit = h.sched.kv_cache_manager.get_computed_blocks(req)
    assert num_hit == 24
    for g, w in enumerate(windows):
        first = 0 if w is None else (24 - w + 1) // 4
        ids = [blk.block_id for blk in hits[g]]
        assert ids == [NULL_BLOCK_ID] * first + h.last_tables["a"][g][first:6]
    assert_hits_hold_group_kv(h, hits, b.prompt)
    h.add(b)
    h.drain()
    h.check_end()
    assert h.stats.cache_hit_tokens == 24
    assert h.results == {s.rid: reference(s, 64, windows) for s in (a, b)}


def evict(h: Harness, block_ids: list[int]) -> None:
    """Take these free cached blocks off the free queue, as new blocks would be, and give
    them back holding nothing."""
    pool = h.sched.kv_cache_manager.block_pool
    for bid in reversed(block_ids):
        assert pool.blocks[bid].ref_cnt == 0 and pool.blocks[bid].block_hash is not None
        pool.free_queue.move_to_end(bid, last=False)
    blocks = pool.get_new_blocks(len(block_ids))
    assert [b.block_id for b in blocks] == block_ids
    pool.free_blocks(blocks)


@pytest.mark.parametrize("windows", [(None, 4), (4, None)])
@pytest.mark.parametrize(("c_len", "hit_blocks"), [(7, 3), (11, 2)])
def test_a_prefix_hit_shrinks_to_what_every_group_still_holds(
        windows: tuple[int | None, ...], c_len: int, hit_blocks: int) -> None:
    """A finished prompt's blocks are freed last position first, group by group within a
    position (the sliding group's first block earlier, behind its window), and evicted in
    that order. A prompt that takes two blocks per group evicts one group's last block of it
    (the full group's with (None, 4), the sliding group's with (4, None)); one that takes
    three, both groups' last blocks and one group's block before. A later prompt sharing all
    16 tokens hits only what both groups still hold, and its tokens are the reference's."""
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8, max_model_len=64,
                          block_size=4, num_blocks=11, kv_group_windows=windows)
    a = Spec("a", list(range(1, 17)), max_tokens=1)
    c = Spec("c", list(range(30, 30 + c_len)), max_tokens=1)
    b = Spec("b", a.prompt + [20], max_tokens=3, ignore_eos=True)
    h = Harness(cfg)
    h.add(a)
    h.drain()
    kv = h.sched.kv_cache_manager
    full, sliding = (0, 1) if windows[0] is None else (1, 0)
    a_full, a_sliding = h.last_tables["a"][full], h.last_tables["a"][sliding]

    def check_hit(n: int) -> None:
        hits, num_hit = kv.get_computed_blocks(b.make())
        assert num_hit == 4 * n
        assert [blk.block_id for blk in hits[full]] == a_full[:n]
        skipped = max(0, n - 1)  # a window of 4 reaches back into the block before only
        assert [blk.block_id for blk in hits[sliding]] == (
            [NULL_BLOCK_ID] * skipped + a_sliding[skipped:n])
        assert_hits_hold_group_kv(h, hits, b.prompt)

    check_hit(4)
    h.add(c)
    h.drain()
    check_hit(hit_blocks)
    h.add(b)
    h.drain()
    h.check_end()
    assert h.results == {s.rid: reference(s, 64, windows) for s in (a, c, b)}
    assert h.stats.cache_hit_tokens == 4 * hit_blocks


@pytest.mark.parametrize("evicted_group", [0, 1])
def test_a_block_cached_in_one_group_is_never_a_hit_in_another(evicted_group: int) -> None:
    """Two full-attention groups compute the same tokens into different blocks (different
    layers' KV). With one group's blocks evicted, a prompt of the same tokens hits nothing:
    the other group's blocks of those tokens are no hit for it."""
    windows = (None, None)
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64,
                          block_size=4, num_blocks=32, kv_group_windows=windows)
    a = Spec("a", list(range(1, 18)), max_tokens=1)
    b = Spec("b", list(range(1, 18)), max_tokens=4, ignore_eos=True)
    h = Harness(cfg)
    h.add(a)
    h.drain()
    kv = h.sched.kv_cache_manager
    hits, num_hit = kv.get_computed_blocks(b.make())
    assert num_hit == 16
    for g in range(2):
        assert [blk.block_id for blk in hits[g]] == h.last_tables["a"][g][:4]
    evict(h, h.last_tables["a"][evicted_group][:4])
    hits, num_hit = kv.get_computed_blocks(b.make())
    assert num_hit == 0 and hits == ([], [])
    h.add(b)
    h.drain()
    h.check_end()
    assert h.results == {s.rid: reference(s, 64, windows) for s in (a, b)}
    assert h.stats.cache_hit_tokens == 0


def test_a_prefix_hit_is_what_every_group_agrees_on_after_they_cut_it_in_turn() -> None:
    """(4, None), blocks of 4: the sliding group needs only the block under its first
    query's window. With its block 2 and the full group's block 3 evicted, the full group
    cuts a 4-block hit to 3; at 3 the sliding group needs its block 2, so the hit is 2 blocks
    (the groups are asked again until they agree), and the tokens are the reference's."""
    windows = (4, None)
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64,
                          block_size=4, num_blocks=32, kv_group_windows=windows)
    a = Spec("a", list(range(1, 18)), max_tokens=1)
    b = Spec("b", list(range(1, 17)) + [30], max_tokens=4, ignore_eos=True)
    h = Harness(cfg)
    h.add(a)
    h.drain()
    sliding, full = h.last_tables["a"]
    evict(h, [sliding[2], full[3]])
    hits, num_hit = h.sched.kv_cache_manager.get_computed_blocks(b.make())
    assert num_hit == 8
    assert [blk.block_id for blk in hits[0]] == [NULL_BLOCK_ID, sliding[1]]
    assert [blk.block_id for blk in hits[1]] == full[:2]
    h.add(b)
    h.drain()
    h.check_end()
    assert h.results == {s.rid: reference(s, 64, windows) for s in (a, b)}
    assert h.stats.cache_hit_tokens == 8


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    # At least one full group, anywhere among up to three sliding ones.
    windows=st.lists(st.one_of(st.none(), WINDOW), max_size=3).flatmap(
        lambda ws: st.permutations([None, *ws])).map(tuple),
    block_size=st.integers(1, 5),
    budget=st.integers(1, 16),
    prompt_len=st.integers(1, 90),
    caching=st.booleans(),
)
def test_a_hybrid_prompt_needs_its_full_groups_and_its_chunks_windows(
    seed: int, windows: tuple[int | None, ...], block_size: int, budget: int,
    prompt_len: int, caching: bool
) -> None:
    """In the smallest pool `prompt_blocks_needed` accepts for a hybrid model (every full
    group holds the whole prompt, each sliding group one chunk's windows), a prompt is
    computed chunk by chunk to its first token, the reference's; one block fewer is
    refused."""
    num_full = windows.count(None)
    need = prompt_blocks_needed(prompt_len, block_size, windows, budget)
    per_group = -(-prompt_len // block_size)
    assert num_full * per_group <= need <= len(windows) * per_group
    cfg = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=budget, max_model_len=200,
                          block_size=block_size, num_blocks=1 + need,
                          enable_prefix_caching=caching, kv_group_windows=windows)
    rng = random.Random(seed)
    spec = Spec("p", [rng.randrange(1, VOCAB) for _ in range(prompt_len)], max_tokens=1,
                ignore_eos=True)
    results, _ = run(cfg, [spec])
    assert results == {"p": reference(spec, 200, windows)}
    assert results["p"][1] == "length" and len(results["p"][0]) == 1
    if need > 1:
        smaller = Scheduler(replace(cfg, num_blocks=need))
        with pytest.raises(ValueError, match="KV blocks"):
            smaller.add_request(spec.make())
