"""Processor: a user's prompt + SamplingParams -> validated, tokenized EngineCoreRequests.

All validation of a request happens here (and in SamplingParams itself), against the limits the
engine core reported (vocabulary, max_model_len, KV capacity), before anything is queued.
"""

from __future__ import annotations

import functools
import numbers
import re
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from jaxllm.engine import EngineCoreInfo, EngineCoreRequest
from jaxllm.lora.adapter import load_adapter
from jaxllm.lora.request import LoRARequest, check_same_adapter
from jaxllm.pooling_params import PoolingParams, wrong_runner
from jaxllm.reasoning import THINK_END, THINK_START
from jaxllm.sampling_params import INT64_MAX, RequestOutputKind, SamplingParams
from scheduler import prompt_blocks_needed

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

PromptType = str | dict[str, Any]

_SURROGATE = re.compile("[\ud800-\udfff]")
# The longest canonical decomposition in Unicode: NFC/NFKC compose at most this many code
# points into one.
_MAX_COMPOSED = 4


def lone_surrogate_at(text: str) -> int | None:
    """Where `text` holds a lone UTF-16 surrogate (no tokenizer or UTF-8 encoder takes one)."""
    m = _SURROGATE.search(text)
    return None if m is None else m.start()


def max_prompt_chars(tokenizer: Any, max_model_len: int) -> int | None:
    """A length in characters beyond which a text certainly needs more than max_model_len
    tokens, so that it can be refused without tokenizing it; None where no such bound is sure.

    For a byte-level BPE tokenizer (no unknown tokens) whose normalizer is at most a Unicode
    normal form: a token stands for at most as many bytes, so characters, of the normalized text
    as its vocabulary string has symbols, and normalizing shrinks a text at most
    `_MAX_COMPOSED`-fold."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or type(backend.decoder).__name__ != "ByteLevel":
        return None
    normalizer = backend.normalizer
    if normalizer is not None and type(normalizer).__name__ not in ("NFC", "NFKC", "NFD",
                                                                     "NFKD"):
        return None
    longest = max(len(t) for t in tokenizer.get_vocab())  # added tokens included
    return max_model_len * longest * _MAX_COMPOSED


@dataclass
class ProcessedPrompt:
    prompt: str | None
    prompt_token_ids: list[int]


@dataclass
class ProcessedRequest:
    """One user request, validated: its prompt and one EngineCoreRequest per sequence."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    child_requests: list[EngineCoreRequest]
    arrival_time: float

    @property
    def child_ids(self) -> list[str]:
        return [r.request_id for r in self.child_requests]


def child_request_ids(request_id: str, n: int) -> list[str]:
    """The core's ids of a request's sequences (vLLM's parallel-sampling naming)."""
    return [request_id] if n == 1 else [f"{i}_{request_id}" for i in range(n)]


class Processor:
    def __init__(self, tokenizer: PreTrainedTokenizerBase | None, info: EngineCoreInfo,
                 eos_token_ids: frozenset[int], max_n: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = info.model_config.vocab_size
        self.max_model_len = info.max_model_len
        self.block_size = info.config.block_size
        self.num_usable_blocks = info.num_usable_blocks
        self.kv_group_windows = info.kv_group_windows
        self.max_num_batched_tokens = info.config.max_num_batched_tokens
        self.eos_token_ids = eos_token_ids
        self.max_n = max_n
        # Each bad word's spellings, once: the server checks a request's words before it
        # submits the request, which tokenizes them again; clients repeat their lists.
        self._bad_word_spellings: dict[str, list[list[int]]] = {}
        self.runner = info.config.runner
        # The think block's tags as token ids, when the engine has a reasoning parser and the
        # tokenizer spells each as one token (a constraint can then wait for the block's end).
        self.reasoning_parser = info.config.reasoning_parser
        self.think_token_ids = think_token_ids(tokenizer, self.reasoning_parser)
        self.hidden_size = info.model_config.hidden_size
        self.model_config = info.model_config
        self.enable_lora = info.config.enable_lora
        self.max_lora_rank = info.config.max_lora_rank
        self.max_cpu_loras = info.config.max_cpu_loras
        # Every adapter id seen -> its first request: an id names one directory for good.
        self._loras: dict[int, LoRARequest] = {}
        # The ids whose directory was read and passed, least recently named first: at most
        # max_cpu_loras, as the engine core keeps; one dropped is read again when named.
        self._checked: OrderedDict[int, None] = OrderedDict()

    @functools.cached_property
    def max_prompt_chars(self) -> int | None:
        """Text prompts longer than this are refused before tokenizing (see
        `max_prompt_chars`); computed on first use from the vocabulary."""
        return None if self.tokenizer is None else max_prompt_chars(self.tokenizer,
                                                                    self.max_model_len)

    def process_inputs(self, request_id: str, prompt: PromptType,
                       params: SamplingParams | PoolingParams | None = None,
                       arrival_time: float | None = None,
                       lora_request: LoRARequest | None = None) -> ProcessedRequest:
        """Validate and tokenize one request (PoolingParams: an embedding request, for a
        pooling runner; `lora_request`: the adapter it runs with); ValueError names what is
        wrong. Children without a seed of their own
        get theirs from the engine when it queues them."""
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty str, got {request_id!r}")
        if isinstance(params, PoolingParams):
            return self.process_pooling(request_id, prompt, params, arrival_time)
        if self.runner == "pooling":
            raise ValueError(wrong_runner(self.runner))
        params = SamplingParams() if params is None else params
        self.check_params(params)
        self.check_lora(lora_request)
        bad_words_ids = self.bad_words_token_ids(params.bad_words)
        always_banned = {w[0] for w in bad_words_ids or () if len(w) == 1}
        if params.allowed_token_ids and set(params.allowed_token_ids) <= always_banned:
            raise ValueError(f"SamplingParams.allowed_token_ids leaves no token: each of "
                             f"{params.allowed_token_ids} is a one-token bad word of "
                             f"{params.bad_words!r}")
        processed = self.process_prompt(prompt,
                                        truncate_prompt_tokens=params.truncate_prompt_tokens)
        num_prompt = len(processed.prompt_token_ids)
        room = self.max_model_len - num_prompt
        if params.min_tokens > room:
            raise ValueError(f"SamplingParams.min_tokens {params.min_tokens} exceeds the "
                             f"{room} tokens max_model_len ({self.max_model_len}) leaves after "
                             f"the {num_prompt}-token prompt")
        self._check_fits(num_prompt)
        arrival_time = time.time() if arrival_time is None else arrival_time
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        reasoning_end = reasoning_start = None
        if params.structured_outputs is not None and self.think_token_ids is not None:
            start, end = self.think_token_ids
            state = self.think_state(processed.prompt_token_ids)
            if state != "closed":
                reasoning_end = end
            if state == "answer":
                reasoning_start = start
        children = []
        for i, cid in enumerate(child_request_ids(request_id, params.n)):
            # A copy: the caller may change or reuse its SamplingParams while this one runs.
            sp = params.clone()
            sp.bad_words_token_ids = bad_words_ids
            if params.n > 1:
                sp.n = 1
                # Child i's seed is the request's + i, wrapped into the seeds' range [0,
                # INT64_MAX] (which the core's decoder checks again).
                sp.seed = None if params.seed is None else (params.seed + i) & INT64_MAX
                if i > 0:
                    # Only the first sequence reports prompt logprobs; the others then take
                    # its prompt blocks from the prefix cache instead of recomputing them.
                    sp.prompt_logprobs = None
            children.append(EngineCoreRequest(
                request_id=cid, prompt_token_ids=processed.prompt_token_ids, sampling_params=sp,
                eos_token_ids=sorted(self.eos_token_ids),
                seed=sp.seed, max_tokens=max_tokens,
                arrival_time=arrival_time, reasoning_end_token_id=reasoning_end,
                reasoning_start_token_id=reasoning_start, lora_request=lora_request))
        return ProcessedRequest(request_id, processed.prompt, processed.prompt_token_ids,
                                children, arrival_time)

    def check_lora(self, lora: LoRARequest | None) -> None:
        """ValueError unless `lora` is None or an adapter this engine can run: its files are
        read unless among the max_cpu_loras adapters named last. The core keeps adapters on
        its own terms (those of its unfinished requests too; each data-parallel core its own),
        so one this check passed unread may still be read there, and refused: the request
        then ends "error", naming why."""
        if lora is None:
            return
        if not isinstance(lora, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(lora).__name__}")
        if not self.enable_lora:
            raise ValueError("lora_request needs an engine started with enable_lora=True")
        if isinstance(lora.lora_int_id, bool) or not isinstance(lora.lora_int_id, int) \
                or not 1 <= lora.lora_int_id <= INT64_MAX:
            # The prefix cache hashes it as a signed 64-bit integer.
            raise ValueError(f"LoRARequest.lora_int_id must be an integer in [1, {INT64_MAX}], "
                             f"got {lora.lora_int_id!r}")
        for name in ("lora_name", "lora_path"):
            if not isinstance(getattr(lora, name), str):
                raise ValueError(f"LoRARequest.{name} must be a str, got "
                                 f"{type(getattr(lora, name)).__name__}")
        lid = lora.lora_int_id
        known = check_same_adapter(self._loras.get(lid), lora)
        if lid in self._checked:
            self._checked.move_to_end(lid)
            return
        load_adapter(lora.lora_path, self.model_config, self.max_lora_rank)
        if not known:
            self._loras[lid] = lora
        self._checked[lid] = None
        if len(self._checked) > self.max_cpu_loras:
            self._checked.popitem(last=False)

    def think_state(self, prompt_token_ids: Sequence[int]) -> str:
        """Where a thinking model's answer to this prompt stands, for a constraint that
        covers only what follows the think block: "closed" (the prompt ends with a closed
        block: Qwen3's template with enable_thinking false; constrained at once), "open" (the
        prompt ends inside one, as DeepSeek-R1's and Qwen3-Thinking-2507's templates open it,
        or the deepseek_r1 parser, whose answers reason until `</think>`: constrained after
        it), "answer" (qwen3: the answer's first token opens a block or is the answer). Tags
        of earlier turns, followed by more than whitespace, do not count."""
        assert self.think_token_ids is not None and self.tokenizer is not None
        start, end = self.think_token_ids
        ids = list(prompt_token_ids)
        last = next((i for i in range(len(ids) - 1, -1, -1) if ids[i] in (start, end)), None)
        # transformers annotates decode's batch form too; one id list gives one string.
        if last is not None and not cast(str, self.tokenizer.decode(ids[last + 1:])).strip():
            return "closed" if ids[last] == end else "open"
        return "open" if self.reasoning_parser == "deepseek_r1" else "answer"

    def process_pooling(self, request_id: str, prompt: PromptType, params: PoolingParams,
                        arrival_time: float | None = None) -> ProcessedRequest:
        """An embedding request: its prompt prefilled and pooled, nothing sampled."""
        if self.runner != "pooling":
            raise ValueError(wrong_runner(self.runner))
        if params.dimensions is not None and params.dimensions > self.hidden_size:
            raise ValueError(f"PoolingParams.dimensions must be at most the model's hidden "
                             f"size ({self.hidden_size}), got {params.dimensions}")
        k = params.truncate_prompt_tokens
        self._check_truncation(k, "PoolingParams")
        processed = self.process_prompt(prompt, truncate_prompt_tokens=k)
        num_prompt = len(processed.prompt_token_ids)
        self._check_fits(num_prompt)
        arrival_time = time.time() if arrival_time is None else arrival_time
        # The scheduler carries sampling parameters with every request; these are never read.
        placeholder = SamplingParams(max_tokens=1, output_kind=RequestOutputKind.FINAL_ONLY)
        child = EngineCoreRequest(
            request_id=request_id, prompt_token_ids=processed.prompt_token_ids,
            sampling_params=placeholder, eos_token_ids=[], max_tokens=1,
            arrival_time=arrival_time, pooling_params=params.clone())
        return ProcessedRequest(request_id, processed.prompt, processed.prompt_token_ids,
                                [child], arrival_time)

    def process_prompt(self, prompt: PromptType, add_special_tokens: bool = True,
                       truncate_prompt_tokens: int | None = None) -> ProcessedPrompt:
        """Tokenize and validate one prompt; ValueError names what is wrong.
        `add_special_tokens=False` for text a chat template rendered: it holds the template's
        own BOS, which the tokenizer would add again. `truncate_prompt_tokens` k: only the last
        k tokens are kept (-1: as many as fit: max_model_len, less one to generate from), before
        the length is checked."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer; pass "
                                 "{'prompt_token_ids': [...]} or drop skip_tokenizer_init")
            at = lone_surrogate_at(prompt)
            if at is not None:
                raise ValueError(f"the prompt contains a lone UTF-16 surrogate "
                                 f"({prompt[at]!a}) at character {at}, which is not valid "
                                 f"Unicode text")
            limit = self.max_prompt_chars
            # A text that is to be truncated may be as long as it likes.
            if limit is not None and len(prompt) > limit and truncate_prompt_tokens is None:
                raise ValueError(f"the prompt has {len(prompt)} characters, more than "
                                 f"max_model_len ({self.max_model_len}) tokens of this "
                                 f"vocabulary can hold")
            text = prompt
            token_ids = self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        elif isinstance(prompt, dict) and ("prompt_token_ids" in prompt or "prompt" in prompt):
            if "prompt_token_ids" in prompt:
                text = prompt.get("prompt")
                raw = prompt["prompt_token_ids"]
                if isinstance(raw, (str, bytes)) or not hasattr(raw, "__iter__"):
                    raise ValueError(f"prompt_token_ids must be a list of integers, "
                                     f"got {type(raw).__name__}")
                raw = list(raw)
                # bool (and numpy bool) is no token id, though Python counts it as an int.
                if not all(isinstance(t, numbers.Integral) and not isinstance(t, bool)
                           for t in raw):
                    raise ValueError("prompt_token_ids must be integers")
                token_ids = [int(t) for t in raw]
            elif isinstance(prompt["prompt"], str):
                return self.process_prompt(prompt["prompt"], add_special_tokens,
                                           truncate_prompt_tokens)
            else:
                # Only text: a dict nested in a dict would recurse as deep as the caller built it.
                raise ValueError(f"a prompt dict's 'prompt' must be a str, got "
                                 f"{type(prompt['prompt']).__name__}")
        else:
            raise ValueError(f"a prompt must be a str or a dict with 'prompt_token_ids', got "
                             f"{type(prompt).__name__}")
        if not token_ids:
            raise ValueError("the prompt is empty (0 tokens)")
        # A prompt to generate from needs room for one new token; one to embed does not.
        longest = self.max_model_len if self.runner == "pooling" else self.max_model_len - 1
        if truncate_prompt_tokens is not None:
            keep = longest if truncate_prompt_tokens == -1 else truncate_prompt_tokens
            if len(token_ids) > keep:
                token_ids = token_ids[-keep:]
                # The text of what is kept, so that an echo, its logprobs and offsets agree.
                text = None if self.tokenizer is None \
                    else cast(str, self.tokenizer.decode(token_ids))
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary "
                             f"[0, {self.vocab_size})")
        if len(token_ids) > longest:
            raise ValueError(f"the prompt has {len(token_ids)} tokens; max_model_len is "
                             f"{self.max_model_len}" + ("" if self.runner == "pooling" else
                                                        " (room for at least one new token is "
                                                        "needed)"))
        return ProcessedPrompt(text, token_ids)

    def check_params(self, params: SamplingParams) -> None:
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be SamplingParams, got "
                             f"{type(params).__name__}")
        if params.n > self.max_n:
            raise ValueError(f"SamplingParams.n must be at most the engine's max_n "
                             f"({self.max_n}), got {params.n}")
        for name, ids in (("stop_token_ids", params.stop_token_ids or ()),
                          ("logit_bias", (params.logit_bias or {}).keys()),
                          ("allowed_token_ids", params.allowed_token_ids or ())):
            bad = [t for t in ids if t >= self.vocab_size]
            if bad:
                raise ValueError(f"SamplingParams.{name} has token ids {bad[:5]} outside the "
                                 f"vocabulary [0, {self.vocab_size})")
        for s in params.stop or ():
            at = lone_surrogate_at(s)
            if at is not None:
                raise ValueError(f"SamplingParams.stop {s[:50]!a} contains a lone UTF-16 "
                                 f"surrogate at character {at}")
        if params.stop and self.tokenizer is None:
            raise ValueError("SamplingParams.stop needs a tokenizer (stop strings match text)")
        if params.structured_outputs is not None and self.tokenizer is None:
            raise ValueError("SamplingParams.structured_outputs needs a tokenizer (its grammar "
                             "constrains text); drop skip_tokenizer_init")
        if params.bad_words and self.tokenizer is None:
            raise ValueError(f"SamplingParams.bad_words needs a tokenizer (the words are "
                             f"tokenized); drop skip_tokenizer_init, got {params.bad_words!r}")
        self._check_truncation(params.truncate_prompt_tokens, "SamplingParams")

    def _check_fits(self, num_prompt: int) -> None:
        need = prompt_blocks_needed(num_prompt, self.block_size, self.kv_group_windows,
                                    self.max_num_batched_tokens)
        if need > self.num_usable_blocks:
            raise ValueError(f"the prompt of {num_prompt} tokens needs {need} KV blocks of "
                             f"{self.block_size} tokens at once; the whole KV cache holds "
                             f"{self.num_usable_blocks}")

    def _check_truncation(self, k: int | None, owner: str) -> None:
        if k is not None and k > self.max_model_len:
            raise ValueError(f"{owner}.truncate_prompt_tokens must be at most max_model_len "
                             f"({self.max_model_len}) or -1, got {k}")

    def bad_words_token_ids(self, bad_words: list[str] | None) -> list[list[int]] | None:
        """vLLM's tokenization of bad words: each word without its leading whitespace, and
        again after one space (a word inside the text, where the tokenizer merges the space
        into its first token) when that spelling starts with a different token and has as
        many tokens; special tokens are not added."""
        if not bad_words:
            return None
        tokenizer = self.tokenizer
        if tokenizer is None:
            raise ValueError("SamplingParams.bad_words needs a tokenizer (the words are "
                             "tokenized); drop skip_tokenizer_init")
        out: list[list[int]] = []
        cache = self._bad_word_spellings
        for word in bad_words:
            spellings = cache.get(word)
            if spellings is None:
                plain = list(tokenizer.encode(word.lstrip(), add_special_tokens=False))
                spaced = list(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
                if not plain:
                    raise ValueError(f"SamplingParams.bad_words has a word with no tokens, "
                                     f"got {word!r}")
                spellings = [plain]
                if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
                    spellings.append(spaced)
                if len(cache) >= 4096:  # bounded: words come from clients
                    cache.clear()
                cache[word] = spellings
            out.extend(list(w) for w in spellings)
        bad = sorted({t for w in out for t in w if not 0 <= t < self.vocab_size})
        if bad:
            raise ValueError(f"SamplingParams.bad_words tokenize to ids {bad[:5]} outside the "
                             f"vocabulary [0, {self.vocab_size})")
        return out


def think_token_ids(tokenizer: PreTrainedTokenizerBase | None, reasoning_parser: str | None
                    ) -> tuple[int, int] | None:
    """(`<think>`, `</think>`) token ids, or None without a parser, a tokenizer, or tags the
    tokenizer spells as one token each."""
    if reasoning_parser is None or tokenizer is None:
        return None
    ids = []
    for tag in (THINK_START, THINK_END):
        encoded = tokenizer.encode(tag, add_special_tokens=False)
        if len(encoded) != 1:
            return None
        ids.append(int(encoded[0]))
    return ids[0], ids[1]
