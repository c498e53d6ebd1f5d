"""Schemathesis against the server's own /openapi.json: for every route, generated requests
(valid ones and ones that break the schema) get no 5xx, and every response matches the schema's
description of it (status code documented, body valid against its schema). A bounded number of
examples per route keeps the run within the suite's budget."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings

schemathesis = pytest.importorskip("schemathesis", reason="schemathesis is in the test extra")
from schemathesis.specs.openapi.checks import (  # noqa: E402
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.server.conftest import HARDENED_KEY  # noqa: E402

EXAMPLES_PER_ROUTE = 25


@pytest.fixture(scope="module")
def api_schema(hardened_server):
    schema = schemathesis.openapi.from_url(hardened_server.url + "/openapi.json")
    schema.config.generation.update(
        modes=[schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE],
        max_examples=EXAMPLES_PER_ROUTE, deterministic=True)
    return schema


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=EXAMPLES_PER_ROUTE, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
def test_no_5xx_and_responses_match_the_schema(case):
    response = case.call_and_validate(
        headers={"Authorization": f"Bearer {HARDENED_KEY}"}, timeout=60,
        checks=[schemathesis.checks.not_a_server_error, status_code_conformance,
                content_type_conformance, response_schema_conformance])
    assert response.status_code < 500
