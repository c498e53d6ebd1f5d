"""Drafter: speculative decoding's worker side (vLLM's model runner `drafter` and its
`propose_draft_token_ids`).

It holds the proposer, n-gram prompt lookup (spec_decode/ngram_proposer.py) or a draft model
(spec_decode/draft_model.py), follows every schedule (the draft model's persistent batch, the
requests it forgets), and after each step's update proposes the next step's drafts for the
running requests about to decode. The engine core hands them to
`Scheduler.update_draft_token_ids`; the scheduler decides how many a step verifies.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

from jaxllm.spec_decode.draft_model import DraftModelProposer
from jaxllm.spec_decode.ngram_proposer import NgramProposer

if TYPE_CHECKING:
    from jaxllm.config import EngineConfig
    from jaxllm.model_executor.config import ModelConfig
    from jaxllm.model_executor.model_loader.loader import LoadedModel
    from scheduler import Request, SchedulerOutput


class Drafter:
    """`max_spec_seqs`: the most requests a step verifies drafts for (the largest spec-decode
    bucket); with more running, no request gets drafts."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig, max_model_len: int,
                 num_blocks: int, target_weights: LoadedModel, max_spec_seqs: int) -> None:
        spec = config.speculative_config
        assert spec is not None  # a Drafter only with speculative decoding
        self.proposer: NgramProposer | DraftModelProposer
        if spec.method == "draft_model":
            self.proposer = DraftModelProposer(config, model_config, max_model_len, num_blocks,
                                               target_weights=target_weights)
        else:
            self.proposer = NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min,
                                          spec.prompt_lookup_max, max_model_len,
                                          config.max_num_seqs)
        self.max_spec_seqs = max_spec_seqs

    def update_states(self, scheduler_output: SchedulerOutput) -> None:
        """Follow a schedule: preempted requests lost their KV and start over; the draft
        model's persistent batch takes the step's block tables."""
        proposer = self.proposer
        if isinstance(proposer, DraftModelProposer):
            proposer.update_states(scheduler_output)
        else:
            for rid in scheduler_output.preempted_req_ids:
                proposer.remove(rid)

    def remove(self, request_id: str) -> None:
        """Forget a request (finished, aborted)."""
        self.proposer.remove(request_id)

    def propose_draft_token_ids(self, new_token_ids: Mapping[str, Sequence[int]],
                                finished_req_ids: Iterable[str],
                                running: Sequence[Request]) -> dict[str, list[int]]:
        """After a step's update: `new_token_ids` the tokens each request accepted in it,
        `finished_req_ids` the requests it ended, `running` the scheduler's running requests.
        Returns the drafts of those about to decode (all their tokens but the last computed,
        nothing in flight); the n-gram proposer's token rows first follow the new tokens."""
        proposer = self.proposer
        for rid in finished_req_ids:
            proposer.remove(rid)
        ngram = proposer if isinstance(proposer, NgramProposer) else None
        if ngram is not None:
            for r in running:
                rid = r.request_id
                if ngram.has_request(rid):
                    if tokens := new_token_ids.get(rid):
                        ngram.append(rid, tokens)
                elif rid in new_token_ids:  # from its first sampled token on
                    ngram.add_request(rid, r.all_token_ids)
        if not running or len(running) > self.max_spec_seqs:
            return {}
        ready = [r for r in running if r.num_computed_tokens == r.num_tokens - 1
                 and not r.num_inflight_tokens
                 and (ngram is None or ngram.has_request(r.request_id))]
        if not ready:
            return {}
        if ngram is not None:
            drafts = ngram.propose([r.request_id for r in ready])
        else:
            assert isinstance(proposer, DraftModelProposer)
            drafts = proposer.propose(ready)
        return {r.request_id: d for r, d in zip(ready, drafts, strict=True)}
