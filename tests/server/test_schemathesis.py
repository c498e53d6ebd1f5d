"""Schemathesis against the server's own /openapi.json: for every route, generated requests
(valid ones and ones that break the schema) get no 5xx, and every response matches the schema's
description of it (status code documented, content type and body valid against its schema). A
bounded number of examples per route and mode keeps the run within the suite's budget."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings

schemathesis = pytest.importorskip("schemathesis", reason="schemathesis is in the test extra")
from schemathesis.specs.openapi.checks import (  # noqa: E402
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.server.conftest import HARDENED_KEY  # noqa: E402

EXAMPLES_PER_ROUTE = 25
VALID_BODIES = {
    "POST /v1/completions": {"prompt": "def f(x):", "max_tokens": 4, "temperature": 0},
    "POST /v1/chat/completions": {"messages": [{"role": "user", "content": "Hi"}],
                                  "max_tokens": 4, "temperature": 0},
    "POST /tokenize": {"prompt": "Hello world"},
    "POST /detokenize": {"tokens": [9707, 1879]},
}
CHECKS = [schemathesis.checks.not_a_server_error, status_code_conformance,
          content_type_conformance, response_schema_conformance]


def fuzz(operation, mode, headers: dict[str, str]) -> set[int]:
    """The status codes of EXAMPLES_PER_ROUTE generated requests, each checked by CHECKS."""
    seen: set[int] = set()

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=EXAMPLES_PER_ROUTE, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    def run(case) -> None:
        # A valid case gets the key; a negative one may carry a broken key of its own, which
        # must get its 401.
        negative = mode is schemathesis.GenerationMode.NEGATIVE
        extra = {} if negative and "Authorization" in (case.headers or {}) else headers
        response = case.call_and_validate(headers=extra, timeout=60, checks=CHECKS)
        assert response.status_code < 500, (case.body, response.text[:300])
        seen.add(response.status_code)

    run()
    return seen


def test_no_5xx_and_responses_match_the_schema(hardened_server):
    schema = schemathesis.openapi.from_url(hardened_server.url + "/openapi.json")
    auth = {"Authorization": f"Bearer {HARDENED_KEY}"}
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.label for op in operations} == {
        "GET /health", "GET /version", "GET /metrics", "GET /v1/models",
        "POST /v1/completions", "POST /v1/chat/completions", "POST /v1/embeddings",
        "POST /tokenize", "POST /detokenize"}
    statuses: dict[str, set[int]] = {}
    for op in operations:
        for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):
            if mode is schemathesis.GenerationMode.NEGATIVE and op.method.upper() == "GET":
                continue  # nothing to break: no parameters, no body
            statuses[f"{op.label} {mode.value}"] = fuzz(op, mode, auth)
    # The valid requests were served, the invalid ones refused.
    # Generated valid requests are served or refused by rules a schema cannot say (a token id
    # past the vocabulary, a logit_bias key that is no integer, a template the server does not
    # trust), never with a 5xx; a plain valid request of each route is served, its response
    # as the schema describes it.
    # (/v1/embeddings: refused, this server runs the generate runner.)
    for route in ("POST /v1/completions", "POST /v1/chat/completions", "POST /v1/embeddings",
                  "POST /tokenize", "POST /detokenize"):
        assert statuses[f"{route} positive"] <= {200, 400}, statuses
    by_label = {op.label: op for op in operations}
    for label, body in VALID_BODIES.items():
        case = by_label[label].Case(body=body, media_type="application/json")
        response = case.call_and_validate(headers=auth, timeout=60, checks=CHECKS)
        assert response.status_code == 200, (label, response.text[:300])
    # A broken body is a 400 (415 for a broken content type, 401 for a broken key), never
    # served.
    for route in ("POST /v1/completions", "POST /v1/chat/completions", "POST /v1/embeddings",
                  "POST /tokenize", "POST /detokenize"):
        assert statuses[f"{route} negative"] <= {400, 401, 404, 413, 415}, statuses
