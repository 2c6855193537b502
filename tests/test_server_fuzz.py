"""Every route of the server driven from its own OpenAPI schema with Schemathesis (issue 38).

A server of a tiny random model (512-token context, so every generation is short) on a loopback
port; Schemathesis reads ``/openapi.json`` from it and sends each operation a bounded number of
generated requests, valid and invalid (Schemathesis' positive and negative modes): no answer may
be 5xx, every 4xx carries an OpenAI error object, and the server answers a normal request to each
route afterwards. Hypothesis is derandomized (its seed fixed), yet the requests drawn after the
first few still differ from one pytest session to the next (they did in this suite: a 500 of the
sampler at float32's edges showed up in some sessions only; now fixed and covered by
tests/test_sampling.py), so a failure prints the request as a curl command to reproduce it.
Nothing leaves the machine: Schemathesis has no telemetry, Hypothesis keeps no example database
here (``database=None``), and every request goes to 127.0.0.1.
"""

from __future__ import annotations

import httpx
import pytest
from conftest import SCHEMATHESIS_MISSING, import_extra
from test_server import InProcessServer

schemathesis = import_extra("schemathesis", SCHEMATHESIS_MISSING)

from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402  (schemathesis brings hypothesis)
from hypothesis.errors import Unsatisfiable  # noqa: E402
from schemathesis.config import SchemathesisConfig  # noqa: E402
from schemathesis.generation import GenerationMode  # noqa: E402

from hybridllm import LLM
from hybridllm.engine.scheduler import Scheduler
from hybridllm.server.app import create_app

pytestmark = pytest.mark.slow  # a few hundred generated requests

MAX_EXAMPLES = 50  # per operation and mode: about 550 requests in all (operations without inputs: one)
SEED = 38
ERROR_KEYS = {"message", "type", "param", "code"}
BODY_ROUTES = ("POST /v1/chat/completions", "POST /v1/completions", "POST /tokenize", "POST /detokenize")
seen_statuses: dict[str, set[int]] = {}


@pytest.fixture(scope="module")
def fuzz_server(tiny_models):
    llm = LLM(tiny_models["llama"][0], device="cpu", threads=1)
    sched = Scheduler(llm.runtime, max_batch=4, max_queue=64)
    app = create_app(llm, sched, max_request_bytes=256 * 1024, stream_stall_timeout_s=10)
    with InProcessServer(app) as srv:
        yield srv.base


@pytest.fixture(scope="module")
def operations(fuzz_server) -> list:
    """Every operation of the server's own schema, read from it over loopback."""
    config = SchemathesisConfig.from_dict({"seed": SEED, "base-url": fuzz_server, "request-timeout": 120})
    schema = schemathesis.openapi.from_url(f"{fuzz_server}/openapi.json", config=config)
    return [result.ok() for result in schema.get_all_operations()]


def check(case, base: str) -> None:
    """One generated request: never 5xx; a 4xx carries an OpenAI error object."""
    response = case.call(base_url=base, timeout=120)
    seen_statuses.setdefault(case.operation.label, set()).add(response.status_code)
    assert response.status_code < 500, (case.as_curl_command(), response.text[:500])
    if response.status_code >= 400 and case.method.upper() != "HEAD":
        error = response.json().get("error")
        assert isinstance(error, dict) and set(error) == ERROR_KEYS, (case.as_curl_command(), response.text[:500])
        assert isinstance(error["message"], str) and 0 < len(error["message"]) < 1000
        assert "Traceback" not in error["message"]


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_no_server_error_and_every_client_error_is_an_openai_error_object(fuzz_server, operations, mode):
    assert fuzz_server.startswith("http://127.0.0.1:") and len(operations) >= 10
    model = httpx.get(f"{fuzz_server}/v1/models").json()["data"][0]["id"]
    for operation in operations:
        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(max_examples=MAX_EXAMPLES, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate])
        def fuzz(case) -> None:
            if mode == GenerationMode.POSITIVE and isinstance(case.body, dict) and "model" in case.body:
                case.body["model"] = model  # the served model: valid requests reach the engine
            check(case, fuzz_server)

        try:
            fuzz()
        except Unsatisfiable:  # nothing to get wrong: an operation without parameters or body
            assert mode == GenerationMode.NEGATIVE and not operation.body and not operation.query, operation.label


def test_the_server_answers_a_normal_request_after_the_fuzzing(fuzz_server):
    # the fuzz got past validation (some generated body was answered 200: which routes, depends on
    # what Hypothesis draws in this session) and was refused where it should be (4xx on each route)
    assert any(200 in seen_statuses[label] for label in BODY_ROUTES), seen_statuses
    for label in BODY_ROUTES:
        assert any(400 <= code < 500 for code in seen_statuses[label]), label
    model = httpx.get(f"{fuzz_server}/v1/models").json()["data"][0]["id"]
    normal = {"/v1/chat/completions": {"model": model, "messages": [{"role": "user", "content": "hello"}],
                                       "max_tokens": 4, "temperature": 0},
              "/v1/completions": {"model": model, "prompt": "hello", "max_tokens": 4, "temperature": 0},
              "/tokenize": {"content": "hello"},
              "/detokenize": {"tokens": [1, 2, 3]}}
    replies = {path: httpx.post(f"{fuzz_server}{path}", json=body, timeout=120) for path, body in normal.items()}
    assert all(reply.status_code == 200 for reply in replies.values()), {p: r.text[:300] for p, r in replies.items()}
    for path in ("/v1/chat/completions", "/v1/completions"):
        assert replies[path].json()["choices"][0]["finish_reason"] in ("stop", "length")
    assert replies["/tokenize"].json()["tokens"]
    health = httpx.get(f"{fuzz_server}/health").json()
    assert health["status"] == "ok" and health["running"] == 0 and health["waiting"] == 0
