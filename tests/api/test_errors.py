"""Every error status with OpenAI's exact body shape {"error": {message, type, param, code}}
(plus the request's ``request_id`` beside it)."""

from __future__ import annotations

from typing import Any

import pytest

from .conftest import Harness, make_config

KEYS = {"message", "type", "param", "code"}


def assert_error(status: int, body: Any, want_status: int, param: str | None,
                 code: str | None = None) -> dict[str, Any]:
    assert status == want_status, body
    assert isinstance(body, dict) and set(body) == {"error", "request_id"}, body
    assert isinstance(body["request_id"], str) and body["request_id"]
    err = body["error"]
    assert set(err) == KEYS, err
    assert isinstance(err["message"], str) and err["message"]
    assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


C = "/v1/completions"
CH = "/v1/chat/completions"


def _tool(name: str, **function: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, **function}}


@pytest.mark.parametrize(
    "path,body,param,code",
    [
        (C, {"prompt": "x", "max_tokens": 0}, "max_tokens", "invalid_value"),
        (C, {"prompt": "x", "max_tokens": "3"}, "max_tokens", "invalid_value"),
        (C, {"prompt": "x", "temperature": 2.5}, "temperature", "invalid_value"),
        (C, {"prompt": "x", "top_p": 0}, "top_p", "invalid_value"),
        (C, {"prompt": "x", "top_k": -2}, "top_k", "invalid_value"),
        (C, {"prompt": "x", "logprobs": 21}, "logprobs", "invalid_value"),
        (C, {"prompt": "x", "stream": "yes"}, "stream", "invalid_value"),
        (C, {"prompt": "x", "stop": [""]}, "stop", "invalid_value"),
        (C, {"prompt": "x", "stop": 3}, "stop", "invalid_value"),
        (C, {"prompt": "x", "min_tokens": 20, "max_tokens": 5}, "min_tokens", "invalid_value"),
        (C, {"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options", None),
        (C, {}, "prompt", "invalid_value"),
        (C, {"prompt": ""}, "prompt", "invalid_value"),
        (C, {"prompt": []}, "prompt", "invalid_value"),
        (C, {"prompt": [1, -1]}, "prompt[1]", "invalid_value"),
        (C, {"prompt": [1, 99999]}, "prompt[1]", "invalid_value"),
        (C, {"prompt": ["a", [1]]}, "prompt[1]", "invalid_value"),  # a list of prompts, mixed
        (C, {"prompt": [[1], [1, -1]]}, "prompt[1][1]", "invalid_value"),
        (C, {"prompt": ["a"] * 33}, "prompt", "invalid_value"),  # server.max_prompts is 32
        (C, {"prompt": "x", "n": 9}, "n", "invalid_value"),  # server.max_n is 8
        (C, {"prompt": "x", "best_of": 3}, "best_of", "unsupported_parameter"),
        (C, {"prompt": "x", "logit_bias": {"abc": 10}}, "logit_bias[abc]", "invalid_value"),
        (C, {"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias[5]", "invalid_value"),
        (C, {"prompt": "x", "logit_bias": {"99999": 1}}, "logit_bias[99999]", "invalid_value"),
        (C, {"prompt": "x", "min_p": 1.5}, "min_p", "invalid_value"),
        (C, {"prompt": "x", "response_format": {"type": "xml"}}, "response_format", None),
        (C, {"prompt": "x", "response_format": {"type": "json_schema"}}, "response_format", None),
        (C, {"prompt": "x", "echo": True, "max_tokens": 0}, "max_tokens", "invalid_value"),
        (C, {"prompt": "x", "suffix": "end"}, "suffix", "unsupported_parameter"),
        (C, {"prompt": "x", "presence_penalty": 2.5}, "presence_penalty", "invalid_value"),
        (C, {"prompt": "x", "frequency_penalty": -3}, "frequency_penalty", "invalid_value"),
        (C, {"prompt": "x", "repetition_penalty": 0}, "repetition_penalty", "invalid_value"),
        (C, {"prompt": "x" * 600}, "prompt", "context_length_exceeded"),
        (C, {"prompt": "x", "max_tokens": 600}, "max_tokens", "context_length_exceeded"),
        (CH, {"messages": []}, "messages", "invalid_value"),
        (CH, {"messages": [{"content": "hi"}]}, "messages[0].role", "invalid_value"),
        (CH, {"messages": [{"role": "user", "content": 5}]}, "messages[0].content", None),
        (CH, {"messages": [{"role": "function", "content": "x"}]}, "messages[0].role", None),
        (CH, {"messages": [{"role": "user", "content": "x", "tool_calls": []}]},
         "messages[0].tool_calls", None),
        (CH, {"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f"}}]}]},
         "messages[0].tool_calls[0].function", None),
        (CH, {"messages": [{"role": "assistant", "tool_calls": {}}]}, "messages[0].tool_calls",
         None),
        (CH, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
         "messages[0].content[0].type", "unsupported_parameter"),
        (CH, {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
         "messages[0].content[0].text", "invalid_value"),
        (CH, {"messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]},
         "messages[0].content[0].text", "invalid_value"),
        ("/tokenize", {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
         "messages[0].content[0].text", "invalid_value"),
        (CH, {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
         "tools[0].function", None),
        (CH, {"messages": [{"role": "user", "content": "x"}], "tools": []}, "tools", None),
        (CH, {"messages": [{"role": "user", "content": "x"}], "tools": [_tool("f")] * 2},
         "tools[1].function.name", None),
        (CH, {"messages": [{"role": "user", "content": "x"}], "tools": [_tool("a b")]},
         "tools[0].function.name", None),
        (CH, {"messages": [{"role": "user", "content": "x"}],
              "tools": [_tool("f", parameters=[1])]}, "tools[0].function.parameters", None),
        (CH, {"messages": [{"role": "user", "content": "x"}],
              "tools": [_tool("f", parameters={"type": "objectx"})]}, "tools", None),
        (CH, {"messages": [{"role": "user", "content": "x"}],
              "tools": [_tool("f", description=5)]}, "tools[0].function.description", None),
        (CH, {"messages": [{"role": "user", "content": "x"}], "tools": [_tool("f")],
              "tool_choice": "sometimes"}, "tool_choice", None),
        (CH, {"messages": [{"role": "user", "content": "x"}], "tools": [_tool("f")],
              "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice", None),
        (CH, {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"},
         "tool_choice", None),
        (CH, {"messages": [{"role": "user", "content": "x"}], "tools": [_tool("f")],
              "response_format": {"type": "json_object"}}, "response_format",
         "unsupported_parameter"),
        (CH, {"messages": [{"role": "user", "content": "x"}], "tools": [_tool("f")],
              "min_tokens": 2}, "min_tokens", "unsupported_parameter"),
        (CH, {"messages": [{"role": "user", "content": "x"}], "functions": [_tool("f")]},
         "functions", "unsupported_parameter"),
        (C, {"prompt": "x", "tools": [_tool("f")]}, "tools", "unsupported_parameter"),
        (CH, {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs",
         None),
        (CH, {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0},
         "max_completion_tokens", None),
        (CH, {"messages": [{"role": "user", "content": "x" * 600}]}, "messages",
         "context_length_exceeded"),
        ("/tokenize", {"prompt": 1}, "prompt", None),
        ("/tokenize", {"prompt": "a", "content": "b"}, "content", None),
        ("/detokenize", {"tokens": [1, 100000]}, "tokens[1]", None),
        ("/detokenize", {"tokens": "abc"}, "tokens", None),
    ],
)
async def test_400_names_the_field(h: Harness, path: str, body: Any, param: str,
                                   code: str | None) -> None:
    status, resp, _ = await h.post(path, body)
    err = assert_error(status, resp, 400, param, code)
    assert err["type"] == "invalid_request_error"


@pytest.mark.parametrize("raw", [b"{", b"", b"nul", b"\xff\xfe", b'{"prompt": "x",}'])
async def test_malformed_json_is_400(h: Harness, raw: bytes) -> None:
    status, resp, _ = await h.post(C, data=raw)
    assert_error(status, resp, 400, None, "invalid_json")


async def test_non_object_body_is_400(h: Harness) -> None:
    status, resp, _ = await h.post(C, data=b"[1,2]")
    assert_error(status, resp, 400, None, "invalid_value")


async def test_unknown_fields_are_ignored(h: Harness) -> None:
    status, resp, _ = await h.post(C, {"prompt": "x", "max_tokens": 2, "store": True,
                                       "metadata": {"a": 1}, "service_tier": "auto"})
    assert status == 200, resp
    assert resp["usage"]["completion_tokens"] == 2


async def test_404_unknown_model(h: Harness) -> None:
    for path, body in [(C, {"model": "nope", "prompt": "x"}),
                       (CH, {"model": "nope", "messages": [{"role": "user", "content": "x"}]}),
                       ("/tokenize", {"model": "nope", "prompt": "x"})]:
        status, resp, _ = await h.post(path, body)
        assert_error(status, resp, 404, "model", "model_not_found")
    r = await h.client.get("/ready?model=nope")
    assert r.status_code == 404


async def test_404_unknown_route_and_405(h: Harness) -> None:
    r = await h.client.get("/v2/nothing")
    import msgspec

    assert_error(r.status_code, msgspec.json.decode(await r.get_data()), 404, None, "not_found")
    r = await h.client.get(C)
    assert_error(r.status_code, msgspec.json.decode(await r.get_data()), 405, None,
                 "method_not_allowed")


async def test_413_body_over_limit(harness_factory: Any) -> None:
    cfg = make_config(server={"max_body_bytes": 1000})
    async with harness_factory(cfg) as h:
        status, resp, _ = await h.post(C, {"prompt": "x" * 2000})
        assert_error(status, resp, 413, None, "request_too_large")
        status, resp, _ = await h.post(C, {"prompt": "x" * 10, "max_tokens": 1})
        assert status == 200


async def test_401_unknown_key_and_tenant_mapping(harness_factory: Any) -> None:
    cfg = make_config(tenants={"alice": {"api_keys": ["ka"]}, "bob": {"api_keys": ["kb"]}})
    async with harness_factory(cfg) as h:
        body = {"prompt": "x", "max_tokens": 1}
        for headers in [{}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic ka"}]:
            status, resp, _ = await h.post(C, body, headers=headers)
            assert_error(status, resp, 401, None, "invalid_api_key")
        r = await h.client.get("/v1/models")
        assert r.status_code == 401
        for key, tenant in [("ka", "alice"), ("kb", "bob")]:
            status, _, _ = await h.post(C, body, headers={"Authorization": f"Bearer {key}"})
            assert status == 200
            assert h.engine.submitted[-1].tenant == tenant
        # health and metrics stay open for probes and scrapers
        assert (await h.client.get("/health")).status_code == 200
        assert (await h.client.get("/metrics")).status_code == 200


async def test_no_tenants_means_default(h: Harness) -> None:
    status, _, _ = await h.post(C, {"prompt": "x", "max_tokens": 1},
                                headers={"Authorization": "Bearer anything"})
    assert status == 200
    assert h.engine.submitted[-1].tenant == "default"


async def test_429_with_retry_after(harness_factory: Any) -> None:
    async with harness_factory(max_running=0) as h:
        status, resp, headers = await h.post(C, {"prompt": "x"})
        err = assert_error(status, resp, 429, None, "rate_limit_exceeded")
        assert err["type"] == "rate_limit_error"
        assert headers["Retry-After"] == "2"


async def test_503_unavailable_with_retry_after(h: Harness) -> None:
    h.engine.unavailable = True
    status, resp, headers = await h.post(CH, {"messages": [{"role": "user", "content": "x"}],
                                              "stream": True})
    err = assert_error(status, resp, 503, None, "model_unavailable")
    assert err["type"] == "service_unavailable"
    assert headers["Retry-After"] == "3"
    r = await h.client.get("/ready")
    assert r.status_code == 503


async def test_device_error_before_output_is_500_not_a_trace(harness_factory: Any) -> None:
    async with harness_factory(fail_after_tokens=0, token_delay=0.001) as h:
        status, resp, _ = await h.post(C, {"prompt": "x", "max_tokens": 3})
        err = assert_error(status, resp, 500, None, "device_error")
        assert "Traceback" not in err["message"]
