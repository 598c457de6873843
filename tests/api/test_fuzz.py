"""Property: no input, however malformed, gets a 5xx or a stack trace from any endpoint."""

from __future__ import annotations

from typing import Any

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st


ENDPOINTS = ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]
FIELDS = [
    "model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p",
    "top_k", "seed", "stop", "stream", "stream_options", "logprobs", "top_logprobs", "echo", "n",
    "best_of", "logit_bias", "suffix", "presence_penalty", "frequency_penalty", "user",
    "ignore_eos", "min_tokens", "tools", "response_format", "tokens", "content", "role",
    "include_usage", "stop_token_ids", "add_generation_prompt", "with_pieces", "type", "text",
]

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=20),
    st.sampled_from(["qwen3", "hi", "user", "assistant", "system", "text", ""]),
    st.integers(min_value=-2, max_value=300),
)
json_values = st.recursive(
    scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=5),
        st.dictionaries(st.one_of(st.sampled_from(FIELDS), st.text(max_size=8)), children,
                        max_size=6),
    ),
    max_leaves=20,
)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool", "x"])},
    optional={"content": json_values},
)
documents = st.dictionaries(
    st.sampled_from(FIELDS),
    st.one_of(json_values, st.lists(message, max_size=3), st.lists(st.integers(-5, 300),
                                                                   max_size=8)),
    max_size=8,
)


def check(status: int, headers: Any, raw: bytes) -> None:
    assert status < 500, raw[:500]
    if status >= 400:
        body = msgspec.json.decode(raw)
        assert set(body) == {"error", "request_id"} and set(body["error"]) == {
            "message", "type", "param", "code"}
        if headers is not None:
            assert body["request_id"] == headers["x-request-id"]
        assert "Traceback" not in body["error"]["message"]


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture], max_examples=150)
@given(path=st.sampled_from(ENDPOINTS), doc=documents, stream=st.booleans())
async def test_random_json_documents_never_5xx(harness_factory: Any, path: str,
                                               doc: dict[str, Any], stream: bool) -> None:
    if stream and "stream" not in doc:
        doc["stream"] = True
    if isinstance(doc.get("max_tokens"), int) and doc["max_tokens"] > 8:
        doc["max_tokens"] = 8  # keep the fake generation short
    # One app per example: pytest-trio runs each hypothesis example in its own trio run.
    async with harness_factory(token_delay=0.0) as h:
        r = await h.client.post(path, data=msgspec.json.encode(doc))
        check(r.status_code, r.headers, await r.get_data())


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture], max_examples=80)
@given(path=st.sampled_from(ENDPOINTS), data=st.one_of(
    st.binary(max_size=200),
    json_values.map(msgspec.json.encode),
    st.text(max_size=100).map(str.encode),
))
async def test_random_bytes_never_5xx(harness_factory: Any, path: str, data: bytes) -> None:
    async with harness_factory(token_delay=0.0) as h:
        r = await h.client.post(path, data=data)
        check(r.status_code, r.headers, await r.get_data())


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture], max_examples=30)
@given(query=st.text(max_size=30), path=st.sampled_from(
    ["/ready", "/health", "/v1/models", "/metrics", "/v1/models/qwen3"]))
async def test_random_get_queries_never_5xx(harness_factory: Any, query: str, path: str) -> None:
    async with harness_factory(token_delay=0.0) as h:
        r = await h.client.get(path, query_string={"model": query})
        assert r.status_code < 500
