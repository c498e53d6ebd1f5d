"""POST /v1/embeddings (OpenAI's embeddings API, vLLM's serving_embedding.py) over a pooling
runner: every input is tokenized and validated first (a bad one is a 400 naming `input` and
nothing is queued), then all are embedded concurrently, each as its own engine request."""

from __future__ import annotations

import asyncio
import base64
from typing import Any

import numpy as np

from jaxllm.engine import EngineDeadError
from jaxllm.entrypoints.openai.protocol import APIError, EmbeddingRequest, parse_request
from jaxllm.entrypoints.openai.serving_engine import OpenAIServing, TokenizedPrompt, random_id
from jaxllm.outputs import EmbeddingRequestOutput
from jaxllm.pooling_params import PoolingParams


def _inputs(value: Any) -> list[str | list[int]]:
    """OpenAI's `input`: one text, one token-id list, or a list of either."""
    if isinstance(value, str):
        return [value]
    if not value:
        raise APIError(400, "input must not be empty", "input")
    if isinstance(value[0], int):
        return [value]
    return list(value)


class OpenAIServingEmbedding(OpenAIServing):
    async def create_embedding(self, body: Any) -> dict[str, Any]:
        self.check_runner("pooling", "/v1/embeddings")
        req: EmbeddingRequest = parse_request(EmbeddingRequest, body)
        if self.check_model(req.model) is not None:
            raise APIError(400, "LoRA adapters serve generation; /v1/embeddings runs the base "
                                "model", "model")
        hidden = self.engine.core_info.model_config.hidden_size
        if req.dimensions is not None and not 1 <= req.dimensions <= hidden:
            raise APIError(400, f"dimensions must be in [1, {hidden}] (the model's hidden "
                                f"size), got {req.dimensions}", "dimensions")
        params = PoolingParams(dimensions=req.dimensions)
        truncate = self.truncate_prompt_tokens(req)
        tokenized = [await self.tokenize(p, param="input", truncate_prompt_tokens=truncate)
                     for p in _inputs(req.input)]
        request_id = random_id("embd")
        tasks = [asyncio.ensure_future(self._embed(t, params, f"{request_id}-{i}"))
                 for i, t in enumerate(tokenized)]
        try:
            outs = await asyncio.gather(*tasks)
        finally:
            for task in tasks:  # one failed or the client left: the others end (and abort)
                task.cancel()
        data = []
        for i, out in enumerate(outs):
            vector = np.asarray(out.outputs.embedding, np.float32)
            embedding: list[float] | str = vector.tolist() \
                if req.encoding_format == "float" \
                else base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
            data.append({"object": "embedding", "index": i, "embedding": embedding})
        num_prompt = sum(len(t.token_ids) for t in tokenized)
        return {"object": "list", "data": data, "model": self.model_name,
                "usage": {"prompt_tokens": num_prompt, "total_tokens": num_prompt}}

    async def _embed(self, prompt: TokenizedPrompt, params: PoolingParams,
                     request_id: str) -> EmbeddingRequestOutput:
        engine_prompt: dict[str, Any] = {"prompt_token_ids": prompt.token_ids}
        if prompt.text is not None:
            engine_prompt["prompt"] = prompt.text
        last: EmbeddingRequestOutput | None = None
        try:
            async for out in self.engine.encode(engine_prompt, params, request_id):
                last = out
        except EngineDeadError as e:
            raise APIError(503, f"the engine is dead and cannot serve requests: {e}",
                           None, "EngineDeadError") from None
        except ValueError as e:
            raise APIError(400, str(e), "input") from None
        finally:
            if self.metrics is not None:
                self.metrics.record_request(len(prompt.token_ids), 0,
                                            last.metrics if last else None,
                                            "stop" if last is not None else "abort")
        if last is None or not last.outputs.embedding:
            raise APIError(500, f"request {request_id} ended without an embedding")
        return last
