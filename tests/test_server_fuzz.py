"""Fuzz the server from its own /openapi.json (schemathesis): valid and invalid bodies on every
route must get no 5xx, only documented status codes and content types, and bodies that match the
documented schemas (OpenAI's error shape for 400/404/413...); bodies the schema calls invalid must
be refused, and a method a route lacks gets a 405 listing those it has. Not checked here: that every
body the schema calls valid is accepted, since a few rules cannot be written in JSON Schema
(max_tokens x n x prompts, prompt + max_tokens within the context, a grammar's or regex's own
syntax); the long run with every check is in bench/RESULTS.md.
Bounded: a few examples per route on a small model with small limits, with the API key on."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    negative_data_rejection,
    not_a_server_error,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
    unsupported_method,
)

from minivllm.config import EngineConfig
from minivllm.engine.llm_engine import LLMEngine
from minivllm.server.limits import ServerLimits
from tests.test_server import MODEL, ServerThread
from tests.test_server_ops import chat_model

KEY = "fuzz-key"  # the server runs with an API key, as a deployed one does: every route is fuzzed behind it
AUTH = {"Authorization": f"Bearer {KEY}"}
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_schema_conformance,
          response_headers_conformance, negative_data_rejection, unsupported_method]


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory):
    from minivllm.server import build_app

    engine = LLMEngine(EngineConfig(chat_model(tmp_path_factory), block_size=8, num_kv_blocks=256,
                                    max_model_len=64, trace_steps=0))
    limits = ServerLimits(max_request_bytes=32 * 1024, max_n=4, max_tokens_times_n=64)
    srv = ServerThread(build_app(engine, MODEL, limits=limits, api_key=KEY))
    srv.url = f"http://127.0.0.1:{srv.port}"
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def api_schema(fuzz_server):
    schema = schemathesis.openapi.from_url(fuzz_server.url + "/openapi.json", headers=AUTH)
    schema.config.generation.update(modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
    return schema


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=8, deadline=None, derandomize=True, suppress_health_check=[
    HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.function_scoped_fixture])
def test_fuzz_openapi(case):
    case.call_and_validate(checks=CHECKS, timeout=20, headers=AUTH)
