"""`LLM`: the offline entrypoint, with vLLM's names, over LLMEngine."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

from tqdm.auto import tqdm

from jaxllm.beam_search import BeamSearchOutput, BeamSearchParams, beam_search
from jaxllm.engine.arg_utils import EngineArgs
from jaxllm.engine.llm_engine import LLMEngine
from jaxllm.engine.processor import ProcessedRequest, PromptType
from jaxllm.entrypoints.utils import enable_compilation_cache
from jaxllm.lora.request import LoRARequest
from jaxllm.outputs import AnyRequestOutput, EmbeddingRequestOutput, RequestOutput
from jaxllm.pooling_params import PoolingParams, wrong_runner
from jaxllm.sampling_params import SamplingParams


class LLM:
    """Generate text with a Qwen2, Qwen3 or Llama model (docs/models.md): `LLM(model=None)`
    uses the embedded default model, `LLM(model="tiny-qwen2")` a tiny random one with the real
    tokenizer. `LLM(model, runner="pooling")` embeds prompts instead (`embed`).

    Every other keyword is an engine argument (EngineArgs), listed with its default and meaning
    in docs/engine_args.md. In multiprocess mode, `shutdown()` (or dropping the LLM) stops the
    core's process.
    """

    def __init__(self, model: str | Path | None = None, dtype: Any = None,
                 **engine_args: Any) -> None:
        self._start(EngineArgs.from_user("LLM", model, dtype, engine_args))

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> LLM:
        llm = cls.__new__(cls)
        llm._start(engine_args)
        return llm

    def _start(self, engine_args: EngineArgs) -> None:
        enable_compilation_cache()
        self.llm_engine = LLMEngine.from_engine_args(engine_args)
        self._request_counter = 0

    def shutdown(self) -> None:
        """Release the engine core (its process, in multiprocess mode); idempotent."""
        self.llm_engine.shutdown()

    @property
    def tokenizer(self):
        return self.llm_engine.tokenizer

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def collective_rpc(self, method: str, args: tuple | list = ()) -> Any:
        """Call `method` on the engine core's model runner, wherever the core runs, and return
        its result (vLLM's name), e.g. `collective_rpc("get_step_shape_counts")`."""
        return self.llm_engine.collective_rpc(method, args)

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
                 ) -> list[RequestOutput]:
        """Complete each prompt; results come back in input order. `lora_request`: one
        adapter for every prompt, or one (or None) per prompt (needs enable_lora).

        All or nothing: every prompt is validated before any is queued; a bad one raises
        ValueError naming its index, and the engine is left as it was.
        """
        if self.llm_engine.engine_config.runner == "pooling":
            raise ValueError(wrong_runner("pooling"))
        prompts, params_list = _per_prompt(prompts, sampling_params, SamplingParams,
                                           "sampling_params")
        if any(isinstance(p, PoolingParams) for p in params_list):
            raise TypeError("sampling_params got PoolingParams: embeddings come from LLM.embed")
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * len(prompts)
        else:
            loras = list(lora_request)
            if len(loras) != len(prompts):
                raise ValueError(f"got {len(prompts)} prompts but {len(loras)} lora_request; "
                                 f"pass one, or one per prompt")
        return cast(list[RequestOutput], self._add_and_run(prompts, params_list, use_tqdm,
                                                           loras))

    def embed(self, prompts: PromptType | Sequence[PromptType],
              pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
              use_tqdm: bool = True) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt, in input order (vLLM's `LLM.embed`): the pooled
        final-normed hidden states of the prompt (pooler_config: the last token's by default,
        L2-normalized). Needs an engine started with runner="pooling". All or nothing, as
        generate()."""
        if self.llm_engine.engine_config.runner != "pooling":
            raise ValueError(wrong_runner(self.llm_engine.engine_config.runner))
        prompts, params_list = _per_prompt(prompts, pooling_params, PoolingParams,
                                           "pooling_params")
        bad = next((p for p in params_list if not isinstance(p, PoolingParams)), None)
        if bad is not None:
            raise TypeError(f"pooling_params must be PoolingParams, got {type(bad).__name__}")
        return cast(list[EmbeddingRequestOutput],
                    self._add_and_run(prompts, params_list, use_tqdm))

    def _add_and_run(self, prompts: list[PromptType],
                     params_list: Sequence[SamplingParams | PoolingParams],
                     use_tqdm: bool, loras: Sequence[LoRARequest | None] | None = None
                     ) -> list[AnyRequestOutput]:
        """Validate every request, queue them, run the engine until they are done."""
        engine = self.llm_engine
        processed: list[ProcessedRequest] = []
        loras = loras or [None] * len(prompts)
        for i, (prompt, sp, lora) in enumerate(zip(prompts, params_list, loras, strict=True)):
            try:
                processed.append(engine.processor.process_inputs(
                    str(self._request_counter + i), prompt, sp, lora_request=lora))
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from e
        added: list[str] = []
        try:
            for req in processed:
                engine.add_processed_request(req)
                added.append(req.request_id)
        except BaseException:
            engine.abort_request(added)
            raise
        self._request_counter += len(processed)
        return self._run_engine(added, use_tqdm)

    def beam_search(self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams,
                    use_tqdm: bool = False, concurrency_limit: int | None = None
                    ) -> list[BeamSearchOutput]:
        """vLLM's beam search (jaxllm/beam_search.py): per prompt, the best
        `params.beam_width` sequences, best first, each with its tokens (prompt included),
        cumulative logprob, text and finish reason. `concurrency_limit`: prompts searched at
        once (None: all)."""
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params must be BeamSearchParams, got {type(params).__name__}")
        if isinstance(prompts, (str, dict)) or not isinstance(prompts, Sequence):
            prompts = [prompts]
        if concurrency_limit is not None and (isinstance(concurrency_limit, bool) or not
                                              isinstance(concurrency_limit, int) or
                                              concurrency_limit < 1):
            raise ValueError(f"concurrency_limit must be a positive integer or None, got "
                             f"{concurrency_limit!r}")
        engine = self.llm_engine
        ids = []
        for i, prompt in enumerate(prompts):
            try:
                ids.append(list(engine.processor.process_prompt(prompt).prompt_token_ids))
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from e
        tokenizer = self.tokenizer
        # transformers annotates decode's batch form too; one id list gives one string.
        decode = None if tokenizer is None else (
            lambda t: cast(str, tokenizer.decode(t, skip_special_tokens=False)))
        chunk = concurrency_limit or max(len(ids), 1)
        results: list[BeamSearchOutput] = []
        with tqdm(total=params.max_tokens * -(-len(ids) // chunk), desc="Beam search",
                  unit="step", disable=not use_tqdm, dynamic_ncols=True) as bar:
            for start in range(0, len(ids), chunk):
                results += beam_search(
                    lambda p, sp: self.generate(p, sp, use_tqdm=False), ids[start:start + chunk],
                    params, engine.processor.eos_token_ids, engine.max_model_len, decode,
                    on_step=lambda: bar.update(1))
        return results

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             tools: list[dict[str, Any]] | None = None,
             chat_template_kwargs: dict[str, Any] | None = None,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
             ) -> list[RequestOutput]:
        """Run one conversation or a list of them through the model's chat template
        (`lora_request` as generate's).

        `tools`: OpenAI tool definitions ({"type": "function", "function": {"name",
        "description", "parameters"}}), rendered by the template (Qwen2.5's asks for calls as
        `<tool_call>{"name": ..., "arguments": ...}</tool_call>`; parse them with
        `jaxllm.entrypoints.openai.tool_parsers.extract_tool_calls`). `chat_template_kwargs`:
        extra variables for the template.
        """
        if self.tokenizer is None:
            raise ValueError("chat() needs a tokenizer; this LLM was made with "
                             "skip_tokenizer_init=True")
        # One conversation (its first item a message) or a list of them; the checker cannot
        # narrow a list by its first item.
        conversations = cast(list[list[dict[str, Any]]], [messages] if messages and isinstance(
            messages[0], dict) else messages)
        # transformers annotates every return kind at once; tokenize=False gives the text.
        texts = [
            cast(str, self.tokenizer.apply_chat_template(
                conv, tools=cast(list[Any] | None, tools), tokenize=False,
                add_generation_prompt=add_generation_prompt,
                **(chat_template_kwargs or {})))
            for conv in conversations]
        # The template wrote the BOS it wants; the tokenizer must not add another.
        processor = self.llm_engine.processor
        prompts: list[PromptType] = []
        for i, text in enumerate(texts):
            params = sampling_params
            if isinstance(params, Sequence) and not isinstance(params, (str, bytes)):
                params = params[i] if i < len(params) else None  # generate() names the mismatch
            # Truncated here too: the whole conversation may be longer than the model takes.
            # Anything but SamplingParams is left for generate() to refuse by name.
            truncate = params.truncate_prompt_tokens \
                if isinstance(params, SamplingParams) else None
            try:
                kept = processor.process_prompt(text, add_special_tokens=False,
                                                truncate_prompt_tokens=truncate)
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from e
            prompts.append({"prompt": kept.prompt, "prompt_token_ids": kept.prompt_token_ids})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm,
                             lora_request=lora_request)

    def _run_engine(self, request_ids: list[str], use_tqdm: bool) -> list[AnyRequestOutput]:
        engine = self.llm_engine
        results: dict[str, AnyRequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="Processed prompts", unit="req",
                   disable=not use_tqdm, dynamic_ncols=True)
        # As vLLM's bar: input and output tokens of the finished requests over the elapsed time.
        in_tokens = out_tokens = 0
        start = time.perf_counter()
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    results[out.request_id] = out
                    bar.update(1)
                    in_tokens += len(out.prompt_token_ids)
                    if isinstance(out, RequestOutput):
                        out_tokens += sum(len(c.token_ids) for c in out.outputs)
                    elapsed = max(time.perf_counter() - start, 1e-9)
                    bar.set_postfix_str(f"est. speed input: {in_tokens / elapsed:.2f} toks/s, "
                                        f"output: {out_tokens / elapsed:.2f} toks/s",
                                        refresh=False)
        except BaseException:
            # Leave the engine clean (blocks returned) if generation is interrupted; only this
            # call's requests: others may belong to another caller of the same engine.
            engine.abort_request([rid for rid in request_ids if rid not in results])
            raise
        finally:
            bar.close()
        return [results[rid] for rid in request_ids]


def _per_prompt(prompts: Any, params: Any, kind: type, name: str
                ) -> tuple[list[PromptType], list[Any]]:
    """The prompts as a list, and their parameters one per prompt: `params` None (kind's
    defaults), one `kind` for all, or a sequence of one per prompt."""
    if isinstance(prompts, (str, dict)) or not isinstance(prompts, Sequence):
        prompts = [prompts]
    prompts = list(prompts)
    if params is None:
        params = kind()
    if isinstance(params, kind):
        return prompts, [params] * len(prompts)
    if isinstance(params, (str, bytes, dict)) or not isinstance(params, Sequence):
        # A dict (say, the parameters' fields) would otherwise be read as its keys.
        raise TypeError(f"{name} must be {kind.__name__} or a sequence of them, got "
                        f"{type(params).__name__}; for a dict of fields, pass "
                        f"{kind.__name__}(**fields)")
    params_list = list(params)
    if len(params_list) != len(prompts):
        raise ValueError(f"got {len(prompts)} prompts but {len(params_list)} {name}; pass "
                         f"one, or one per prompt")
    return prompts, params_list
