"""vLLM's `use_beam_search` on the completions and chat routes: which request fields the search
honours, and the search (jaxllm/beam_search.py) driven over AsyncLLM, each step's one-token
requests at once."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, Any, cast

from jaxllm.beam_search import BeamSearch, BeamSearchParams, step_params
from jaxllm.engine import EngineDeadError
from jaxllm.entrypoints.openai.protocol import APIError
from jaxllm.outputs import CompletionOutput, Logprob, RequestOutput
from jaxllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from jaxllm.entrypoints.openai.serving_engine import (
        Constraint,
        OpenAIServing,
        TokenizedPrompt,
    )

# Fields the search does not honour (it ranks the raw logprobs and ends a beam only on an
# end-of-sequence token), with the values that leave them unset: what OpenAI clients send by
# default is no request for them.
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "stop": (None, [], ""), "stop_token_ids": (None, []), "logit_bias": (None, {}),
    "allowed_token_ids": (None,), "bad_words": (None, []), "top_p": (None, 1.0),
    "top_k": (None, -1, 0), "min_p": (None, 0.0), "presence_penalty": (None, 0.0),
    "frequency_penalty": (None, 0.0), "repetition_penalty": (None, 1.0), "min_tokens": (0,),
    "prompt_logprobs": (None,)}


def check_lora_beam(req: Any, lora: Any) -> None:
    """A 400 for a beam search with a LoRA adapter: the search's steps run without one."""
    if req.use_beam_search and lora is not None:
        raise APIError(400, "use_beam_search does not run with a LoRA adapter", "model")


def check_beam_search(req: Any, constraint: Constraint | None) -> None:
    """A 400 naming what of the request a beam search would ignore (before anything is
    validated or compiled for it), or `length_penalty` without one."""
    if not req.use_beam_search:
        if req.length_penalty != 1.0:
            raise APIError(400, "length_penalty applies only with use_beam_search",
                           "length_penalty")
        return
    for name, neutral in _NEUTRAL.items():
        if getattr(req, name, None) not in neutral:
            raise APIError(400, f"{name} is not supported with use_beam_search (the search "
                                f"ranks the model's raw logprobs and ends a beam only on an "
                                f"end-of-sequence token)", name)
    if constraint is not None:
        raise APIError(400, f"{constraint.source} is not supported with use_beam_search",
                       constraint.source)


def beam_search_params(req: Any, params: SamplingParams) -> BeamSearchParams | None:
    """The search's parameters from the request (`n` beams) and its SamplingParams; None for
    a sampled request."""
    if not req.use_beam_search:
        return None
    if params.prompt_logprobs is not None:  # echo with logprobs asks for them
        raise APIError(400, "echo with logprobs is not supported with use_beam_search (the "
                            "search computes no prompt logprobs)", "echo")
    assert params.max_tokens is not None  # the server's sampling_params() sets it
    try:
        return BeamSearchParams(beam_width=req.n, max_tokens=params.max_tokens,
                                ignore_eos=req.ignore_eos, temperature=params.temperature,
                                length_penalty=req.length_penalty,
                                include_stop_str_in_output=req.include_stop_str_in_output)
    except ValueError as e:
        message = str(e).replace("BeamSearchParams.beam_width", "n (the beam width)")
        field = next((f for f in ("beam_width", "length_penalty") if f in str(e)), None)
        raise APIError(400, message, "n" if field == "beam_width" else field) from None


async def beam_search(serving: OpenAIServing, prompt: TokenizedPrompt, beam: BeamSearchParams,
                      params: SamplingParams, request_id: str
                      ) -> AsyncGenerator[RequestOutput, None]:
    """One RequestOutput with the best `beam.beam_width` beams as its outputs, once the search
    ends. A choice's logprobs (when `params.logprobs` asks) are its tokens' top ones among the
    ranked candidates. A step that fails cancels its siblings (the engine aborts them)."""
    engine = serving.engine
    search = BeamSearch([prompt.token_ids], beam, engine.processor.eos_token_ids,
                        serving.max_model_len)
    sp = step_params(beam)
    reason: str | None = "abort"
    num_generated = 0

    async def one(ids: list[int], rid: str) -> dict[int, Logprob]:
        last = None
        async for out in engine.generate({"prompt_token_ids": ids}, sp, rid):
            last = out
        if last is None or not last.outputs or not last.outputs[0].logprobs:
            why = last.outputs[0].finish_reason if last is not None and last.outputs else None
            raise APIError(503, f"a beam search step ended without its token (finish_reason "
                                f"{why!r}): the engine stopped it")
        return last.outputs[0].logprobs[0]

    try:
        while (prompts := search.step_prompts()) is not None:
            tasks = [asyncio.ensure_future(one(ids, f"{request_id}-beam{search.steps}-{k}"))
                     for k, ids in enumerate(prompts)]
            try:
                rows = await asyncio.gather(*tasks)
            except BaseException:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                raise
            search.advance(rows)
        tokenizer = serving.tokenizer
        (result,) = search.results(lambda ids: cast(str, tokenizer.decode(
            ids, skip_special_tokens=params.skip_special_tokens)))
        outputs = []
        for i, seq in enumerate(result.sequences):
            token_ids = seq.tokens[len(prompt.token_ids):]
            num_generated += len(token_ids)
            logprobs = None
            if params.logprobs is not None:
                k = params.logprobs
                logprobs = [{t: lp for t, lp in row.items()
                             if t == tok or (lp.rank is not None and lp.rank <= k)}
                            for row, tok in zip(seq.logprobs, token_ids, strict=True)]
            outputs.append(CompletionOutput(
                index=i, text=seq.text or "", token_ids=token_ids,
                cumulative_logprob=seq.cum_logprob, logprobs=logprobs,
                finish_reason=seq.finish_reason, stop_reason=seq.stop_reason))
        reason = "stop" if any(o.finish_reason == "stop" for o in outputs) else "length"
        yield RequestOutput(request_id, prompt.text, list(prompt.token_ids), outputs, True)
    except EngineDeadError as e:
        raise APIError(503, f"the engine is dead and cannot serve requests: {e}", None,
                       "EngineDeadError") from None
    except ValueError as e:
        raise APIError(400, str(e)) from None
    finally:
        if serving.metrics is not None:
            serving.metrics.record_request(len(prompt.token_ids), num_generated, None, reason,
                                           beam.beam_width)
