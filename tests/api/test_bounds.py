"""Issue 12, class 1: every request parameter is bounded to what the layers below can represent.

A value at or past any bound answers 200 or a 400 naming the field, never a 5xx, and the engine
keeps serving the same greedy output afterwards. The reproduction of the one-request outage
(``top_k`` = 2**63 crashed the sampler and stopped the engine) is pinned first; then every field
at and past its bounds, one by one and in random combinations (hypothesis, integer and float
extremes); then defence in depth: a sampler that raises for one lane fails that request alone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec
import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import calserve.engine.completion as completion_mod
from calserve.engine.sampler import sample_batch

from .conftest import make_config
from .real_engine import RealHarness, real_app
from .sse_util import parse_sse, stream_post

C = "/v1/completions"
CH = "/v1/chat/completions"
R = "/v1/responses"

INT_EXTREMES = [-(2**70), -(2**64), -(2**63) - 1, -(2**63), -(2**31) - 1, -(2**31), -2, -1, 0, 1,
                127, 128, 129, 2**31 - 1, 2**31, 2**32, 2**63 - 1, 2**63, 2**64, 2**70]
FLOAT_EXTREMES = [-1e308, -2.0000001, -2.0, -1e-300, -0.0, 0.0, 5e-324, 1e-300, 0.5, 1.0,
                  1.0000001, 2.0, 2.0000001, 10.0, 10.000001, 1e308]
FIELDS = ["max_tokens", "temperature", "top_p", "top_k", "seed", "min_tokens", "logprobs",
          "n", "best_of", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p",
          "prompt_logprobs", "include_stop_str_in_output", "skip_special_tokens",
          "truncate_prompt_tokens"]
LIST_FIELDS = ["stop_token_ids", "stop", "allowed_token_ids"]
CHAT_FIELDS = ["max_completion_tokens", "top_logprobs"]


def _js(schema: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def _nested(levels: int) -> dict[str, Any]:
    s: dict[str, Any] = {"type": "string"}
    for _ in range(levels):
        s = {"type": "object", "properties": {"a": s}, "required": ["a"]}
    return s


def _any_of(levels: int) -> dict[str, Any]:
    s: dict[str, Any] = {"type": "string"}
    for _ in range(levels):
        s = {"anyOf": [s, {"type": "object", "properties": {"b": s}}]}
    return s


def _props(n: int) -> dict[str, Any]:
    return {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(n)}}


# response_format schemas past their size bounds (engine/grammar.py: compile time grows with
# them, quadratically or worse), each a 400 naming response_format, and ones at the bounds.
SCHEMAS_PAST_BOUNDS = [
    _js(_nested(16)),  # 16 levels of properties = 48 nested values > MAX_SCHEMA_DEPTH 32
    _js(_props(257)), _js(_props(5000)),  # 5,000 optional properties took 4.7 s to compile
    _js({"enum": list(range(1025))}), _js({"enum": [f"v{i}" for i in range(20000)]}),
    _js(_any_of(7)), _js(_any_of(12)),  # 12 nested anyOf: 0.4-0.8 s
    _js({"type": "object", "properties": {f"p{i}": {"enum": list(range(20))}
                                          for i in range(250)}}),  # > MAX_SCHEMA_NODES
]
SCHEMAS_AT_BOUNDS = [_js(_nested(9)), _js(_props(256)), _js({"enum": list(range(1024))}),
                     _js(_any_of(3))]
# Object-valued fields and hostile values for them (the test model's vocabulary is 128 ids).
OBJECT_FIELDS: dict[str, list[Any]] = {
    # a list of prompts (server.max_prompts, default 32): every item is checked as a prompt is
    "prompt": [
        ["hi", "there"], ["a"] * 32, ["a"] * 33, ["a", ""], ["a", [1]], ["a", None], [["a"]],
        [[1, 2], [3]], [[1], []], [[1], [2**63]], [[1], [-1]], [[1], [128]], [[1], [1.5]],
        [[1], list(range(1, 128)) * 5], ["x" * 10**5, "y"], [[]], [""],
    ],
    "logit_bias": [
        {"0": 100}, {"5": -100}, {"127": 0.5}, {"0": 100.0001}, {"0": -100.5}, {"0": 2**63},
        {"0": 1e308}, {"0": -1e308}, {"0": "a"}, {"0": None}, {"0": True}, {"0": [1]},
        {"-1": 1}, {"128": 1}, {str(2**63): 1}, {str(2**70): 1}, {"x": 1}, {"": 1}, {" 1": 2},
        {str(i): 1 for i in range(1025)}, {str(i): -100 for i in range(128)}, [], "x", 3,
    ],
    "response_format": [
        {"type": "text"}, {"type": "json_object"}, {"type": "xml"}, {"type": None}, {}, [], "x",
        {"type": "json_schema"}, {"type": "json_schema", "json_schema": None},
        {"type": "json_schema", "json_schema": {"schema": {"type": "string", "maxLength": 2**70}}},
        {"type": "json_schema", "json_schema": {"schema": {"type": "array", "minItems": 2**63}}},
        {"type": "json_schema", "json_schema": {"schema": {"$ref": "#/x"}, "strict": True}},
        {"type": "json_schema", "json_schema": {"schema": {}, "strict": 2**63}},
        *SCHEMAS_PAST_BOUNDS, *SCHEMAS_AT_BOUNDS,
    ],
}


async def greedy_text(h: RealHarness) -> str:
    status, body, _ = await h.post(C, {"prompt": "hello", "max_tokens": 6, "temperature": 0})
    assert status == 200, body
    return str(body["choices"][0]["text"])


async def expect_bounded(h: RealHarness, path: str, doc: dict[str, Any], field: str | None,
                         named: Callable[[dict[str, Any]], bool] | None = None) -> int:
    """POST ``doc``: 200 (a complete answer) or 4xx naming ``field`` (when given): its ``param``
    up to a ``[`` is ``field``, or ``named(error)`` says so. A stream ends as its route ends one
    (``[DONE]``; a Responses stream with its completed or incomplete response)."""
    with trio.fail_after(20):
        status, raw = await stream_post(h.client, path, doc)
    assert status < 500, (doc, raw[:300])
    if status >= 400:
        err = msgspec.json.decode(raw)["error"]
        assert set(err) == {"message", "type", "param", "code"}
        if field is not None and status == 400:
            ok = named(err) if named is not None else (
                err["param"] is not None and err["param"].split("[")[0] == field)
            assert ok, (doc, err)
    elif doc.get("stream") and path == R:
        last = raw.rstrip().rsplit(b"\n\n", 1)[-1]
        assert last.startswith((b"event: response.completed", b"event: response.incomplete")), \
            (doc, last)
    elif doc.get("stream"):
        assert parse_sse(raw)[-1] == "[DONE]"
    return status


async def test_huge_top_k_is_a_400_and_the_engine_keeps_serving() -> None:
    """The reproduction from the issue: one request used to stop the whole server."""
    async with real_app(make_config()) as h:
        before = await greedy_text(h)
        status, body, _ = await h.post(C, {"prompt": "Hello", "max_tokens": 4, "temperature": 1,
                                           "top_k": 9223372036854775808})
        assert status == 400
        err = body["error"]
        assert err["param"] == "top_k" and err["code"] == "invalid_value"
        # a k beyond the vocabulary (but representable) is "no cut-off", not an error
        status, _, _ = await h.post(C, {"prompt": "Hello", "max_tokens": 4, "temperature": 1,
                                        "top_k": 2**31 - 1, "seed": 2**63 - 1})
        assert status == 200
        assert h.real_engine.ready()
        assert await greedy_text(h) == before


async def test_every_field_at_and_past_its_bounds() -> None:
    async with real_app(make_config()) as h:
        before = await greedy_text(h)
        statuses: dict[str, set[int]] = {}
        for field in FIELDS + CHAT_FIELDS:
            for v in [*INT_EXTREMES, *FLOAT_EXTREMES]:
                chat = field in CHAT_FIELDS
                doc: dict[str, Any] = (
                    {"messages": [{"role": "user", "content": "hi"}], "logprobs": True}
                    if chat else {"prompt": "hi"})
                doc.update({"max_tokens": 3, "temperature": 1.0, "top_k": 5, field: v})
                if field in ("max_tokens", "max_completion_tokens") and v in (1, 127):
                    doc[field] = 1 if v == 1 else 3
                st_ = await expect_bounded(h, CH if chat else C, doc, field)
                statuses.setdefault(field, set()).add(st_)
        for field in LIST_FIELDS:
            for v in ([2**63], [128], [-1], list(range(257)), list(range(100)), ["x" * 257],
                      ["x" * 256], ["a"] * 17, [""], "y" * 300):
                doc = {"prompt": "hi", "max_tokens": 3, "temperature": 1.0, field: v}
                if field in ("stop_token_ids", "allowed_token_ids") and isinstance(v, str):
                    continue
                if field == "stop" and v and isinstance(v, list) and isinstance(v[0], int):
                    continue
                st_ = await expect_bounded(h, C, doc, field)
                statuses.setdefault(field, set()).add(st_)
        # echo with logprobs scores the prompt (a decode step per prompt token): with every
        # logprobs and max_tokens extreme, and the prompt lists
        for field in ("logprobs", "max_tokens"):
            for v in [*INT_EXTREMES, *FLOAT_EXTREMES]:
                doc = {"prompt": "hi", "max_tokens": 0, "logprobs": 2, "echo": True, field: v}
                if field == "max_tokens" and isinstance(v, int) and v > 3:
                    doc[field] = 3 if v < 2**31 else v
                st_ = await expect_bounded(h, C, doc, field)
                statuses.setdefault(f"echo+{field}", set()).add(st_)
        for v in [*INT_EXTREMES, *FLOAT_EXTREMES]:  # vLLM's prompt_logprobs, nothing generated
            doc = {"prompt": "hi", "max_tokens": 0, "prompt_logprobs": v}
            st_ = await expect_bounded(h, C, doc, "prompt_logprobs")
            statuses.setdefault("score+prompt_logprobs", set()).add(st_)
        for v in OBJECT_FIELDS["prompt"]:
            doc = {"prompt": v, "max_tokens": 1, "logprobs": 1, "echo": True}
            st_ = await expect_bounded(h, C, doc, "prompt")
            statuses.setdefault("echo+prompt", set()).add(st_)
        for field, values in OBJECT_FIELDS.items():
            for v in values:
                doc = {"prompt": "hi", "max_tokens": 3, "temperature": 1.0, field: v}
                st_ = await expect_bounded(h, C, doc, field)
                statuses.setdefault(field, set()).add(st_)
        # every field both accepts a value and refuses one (the sweep reached both sides)
        for field, seen in statuses.items():
            assert 400 in seen, field
        for field in ("max_tokens", "temperature", "top_p", "top_k", "seed", "min_tokens",
                      "logprobs", "stop_token_ids", "stop", "n", "presence_penalty",
                      "frequency_penalty", "repetition_penalty", "min_p", "logit_bias",
                      "response_format", "prompt", "echo+logprobs", "echo+max_tokens",
                      "echo+prompt", "prompt_logprobs", "score+prompt_logprobs",
                      "allowed_token_ids", "truncate_prompt_tokens"):
            assert 200 in statuses[field], field
        assert h.real_engine.ready()
        assert await greedy_text(h) == before


async def test_response_format_schema_size_is_bounded() -> None:
    """Issue 17's leftover: a schema past a size bound (depth, values, properties, list items,
    nested alternatives) is a 400 naming response_format that says which bound, before
    llguidance compiles it (the bound check comes first: this test model has no grammar
    tokenizer, so every schema is refused, but only past-bound ones for their size). That the
    schemas at the bounds compile, in bounded time: tests/engine_parts/test_parts_grammar.py."""
    async with real_app(make_config()) as h:
        before = await greedy_text(h)
        for rf in SCHEMAS_PAST_BOUNDS:
            t = trio.current_time()
            status, body, _ = await h.post(C, {"prompt": "hi", "max_tokens": 3,
                                               "response_format": rf})
            assert status == 400 and body["error"]["param"] == "response_format", (rf, body)
            assert any(w in body["error"]["message"] for w in ("deeper", "too large", "keys",
                                                               "items", "nests")), body
            assert trio.current_time() - t < 2.0
        for rf in SCHEMAS_AT_BOUNDS:
            status, body, _ = await h.post(C, {"prompt": "hi", "max_tokens": 3,
                                               "response_format": rf})
            assert status == 400 and "tokenizer" in body["error"]["message"], body
        assert h.real_engine.ready()
        assert await greedy_text(h) == before


extreme = st.one_of(
    st.sampled_from(INT_EXTREMES), st.sampled_from(FLOAT_EXTREMES),
    st.integers(), st.floats(allow_nan=False, allow_infinity=False),
    st.lists(st.integers(min_value=-(2**65), max_value=2**65), max_size=4),
    st.lists(st.text(max_size=300), max_size=18), st.none(), st.booleans(),
)


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture], max_examples=40)
@given(fields=st.dictionaries(st.sampled_from(FIELDS + CHAT_FIELDS + LIST_FIELDS
                                              + list(OBJECT_FIELDS) + ["echo"]),
                              st.one_of(extreme, st.sampled_from(
                                  [v for vs in OBJECT_FIELDS.values() for v in vs])),
                              min_size=1, max_size=5),
       chat=st.booleans(), stream=st.booleans())
async def test_random_extremes_answer_200_or_400_and_leave_the_engine_live(
        fields: dict[str, Any], chat: bool, stream: bool) -> None:
    for k in ("max_tokens", "max_completion_tokens"):
        v = fields.get(k)
        if isinstance(v, int) and not isinstance(v, bool) and 4 < v < 2**31:
            fields[k] = 4  # keep generation short (real time); out-of-range values stay
    base: dict[str, Any] = ({"messages": [{"role": "user", "content": "hi"}]} if chat
                            else {"prompt": "hi"})
    doc = {**base, "max_tokens": 4, "temperature": 1.0, **fields, "stream": stream}
    async with real_app(make_config()) as h:
        await expect_bounded(h, CH if chat else C, doc, None)
        assert h.real_engine.ready()
        status, _, _ = await h.post(C, {"prompt": "hello", "max_tokens": 2, "temperature": 0})
        assert status == 200


async def test_a_sampler_failure_fails_that_request_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """Defence in depth: an exception while sampling one lane ends that request with an error;
    the other requests of the batch and the engine carry on."""

    def flaky(rows: Any, lanes: Any) -> Any:
        if any(ln.top_k == 7 for ln in lanes):
            raise OverflowError("injected")
        return sample_batch(rows, lanes)

    monkeypatch.setattr(completion_mod, "sample_batch", flaky)
    async with real_app(make_config()) as h:
        before = await greedy_text(h)
        results: dict[str, Any] = {}

        async def one(name: str, doc: dict[str, Any]) -> None:
            status, body, _ = await h.post(C, doc)
            results[name] = (status, body)

        async with trio.open_nursery() as n:
            n.start_soon(one, "bad", {"prompt": "hi", "max_tokens": 5, "temperature": 1,
                                      "top_k": 7, "seed": 1})
            for i in range(3):
                n.start_soon(one, f"ok{i}", {"prompt": "hi", "max_tokens": 5, "temperature": 1,
                                             "top_k": 3, "seed": i})
        status, body = results["bad"]
        assert status == 500 and body["error"]["code"] == "internal_error"
        for i in range(3):
            assert results[f"ok{i}"][0] == 200
        assert h.real_engine.ready()
        assert await greedy_text(h) == before
        st_ = h.real_engine.statistics()
        assert st_ is not None


def _tool(name: Any = "f", **function: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, **function}}


# Tool calling's fields (api/tools.py), the chat template's variables (chat_prompt.template_variables)
# and reasoning_format (api/reasoning.py),
# each alone on a chat request: 200 (tool_choice "none" leaves the tools out, so this test model
# needs no grammar tokenizer) or a 400 naming the field.
TOOL_FIELDS: dict[str, list[Any]] = {
    "tools": [
        [_tool()], [_tool(f"t{i}") for i in range(128)], [_tool(f"t{i}") for i in range(129)],
        [], "x", 3, [{}], [None], [_tool(2**63)], [_tool("x" * 65)], [_tool("é")],
        [_tool(description="d" * 4097)], [_tool(parameters=[])], [_tool(strict=2**63)],
        *[[_tool(parameters=rf["json_schema"]["schema"])] for rf in SCHEMAS_PAST_BOUNDS],
    ],
    "tool_choice": ["none", "auto", "required", {}, [], 2**63, "x" * 10**4,
                    {"type": "function", "function": {"name": "x" * 10**4}}],
    "parallel_tool_calls": [True, False, 2**63, "x", None],
    "chat_template_kwargs": [
        None, {}, {"enable_thinking": False}, {f"k{i}": i for i in range(32)},
        {f"k{i}": i for i in range(33)}, {"k": "x" * 65000}, {"k": "x" * 70000}, {"x" * 64: 1},
        {"x" * 65: 1}, {"messages": []}, {"tools": 1}, {"a b": 1}, {"1a": 1}, {"é": 1}, [], "x",
        2**63, {"k": [[[[[[[[[[[]]]]]]]]]]]}, {"k": 2**70},
    ],
    "reasoning_format": ["auto", "none", None, "deepseek", "", "x" * 10**4, 2**63, [], {}],
}


async def test_tool_fields_at_and_past_their_bounds() -> None:
    async with real_app(make_config()) as h:
        before = await greedy_text(h)
        for field, values in TOOL_FIELDS.items():
            seen = set()
            for v in values:
                doc: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}],
                                       "max_tokens": 3, field: v}
                if field == "tools":
                    doc["tool_choice"] = "none"  # validated all the same, then left out
                for stream in (False, True):
                    seen.add(await expect_bounded(h, CH, {**doc, "stream": stream}, field))
            assert seen == {200, 400}, (field, seen)
        # past a schema bound: the 400 says which one, before anything is compiled
        for rf in SCHEMAS_PAST_BOUNDS:
            status, body, _ = await h.post(CH, {"messages": [{"role": "user", "content": "hi"}],
                                                "tools": [_tool(parameters=rf["json_schema"]["schema"])]})
            assert status == 400 and body["error"]["param"] == "tools", body
            assert any(w in body["error"]["message"] for w in ("deeper", "too large", "keys",
                                                               "items", "nests")), body
        assert h.real_engine.ready()
        assert await greedy_text(h) == before


# /v1/responses' own fields (api/responses.py), each alone: 200 or a 400 naming the field.
RESPONSES_FIELDS: dict[str, list[Any]] = {
    "input": ["hi", "", [], [{"role": "user", "content": "hi"}], [{}], [None], "x" * 10**5,
              [{"role": "user", "content": [{"type": "input_text", "text": 2**63}]}], 2**63,
              [{"role": "user", "content": [{"type": "input_text", "text": "a"}] * 10**4}],
              [{"type": "function_call_output", "call_id": "c", "output": "x" * 10**5}],
              [{"role": []}], [{"role": {}, "content": "x"}], [{"type": []}], [{"type": {"a": 1}}],
              [{"type": "function_call", "call_id": [], "name": "f", "arguments": "{}"}],
              [{"type": "function_call_output", "call_id": "c", "output": [{"type": []}]}]],
    "instructions": [None, "", "be brief", "x" * 10**5, 2**63, []],
    "max_output_tokens": INT_EXTREMES,
    "temperature": FLOAT_EXTREMES,
    "top_p": FLOAT_EXTREMES,
    "seed": INT_EXTREMES,
    "metadata": [{}, {"k": "v"}, {f"k{i}": "v" for i in range(16)},
                 {f"k{i}": "v" for i in range(17)}, {"k": 1}, [], "x"],
    "text": [{"format": {"type": "text"}}, {"format": {"type": "xml"}}, {"format": None}, {},
             [], "x", {"format": "x"}, {"format": {"type": "json_schema", "schema": 2**63}}],
    "tools": [[{"type": "function", "name": "f"}], [{"type": "web_search"}], [{}], "x", [None],
              [{"type": "function", "name": "x" * 65}]],
    "tool_choice": ["none", "auto", "x", {}, {"type": "function"}, 2**63, []],
    "parallel_tool_calls": [True, False, 2**63, "x"],
    "previous_response_id": [None, "r", 2**63, "", "x" * 257, []],
    "include": [None, [], ["x"], "x", ["message.output_text.logprobs"], ["x"] * 17],
    "top_logprobs": [None, 0, 20, 21, -1, 2**63, "x"],
    "truncation": [None, "disabled", "auto", "x", 2**63],
    "background": [None, False, True, "x"],
    "store": [None, True, False, "x"],
    "user": ["u", "x" * 1025, 2**63],
}


async def test_responses_fields_at_and_past_their_bounds() -> None:
    async with real_app(make_config()) as h:
        before = await greedy_text(h)
        for field, values in RESPONSES_FIELDS.items():

            def named(err: dict[str, Any], field: str = field) -> bool:
                # a prompt too long for the context is the conversation's: `input`
                return bool(err["param"].startswith(field) or (
                    field == "instructions" and err["param"] == "input"
                    and err["code"] == "context_length_exceeded"))

            seen = set()
            for v in values:
                doc: dict[str, Any] = {"input": "hi", "max_output_tokens": 3, field: v}
                if field == "tools":
                    doc["tool_choice"] = "none"  # validated all the same, then left out
                for stream in (False, True):
                    status = await expect_bounded(h, R, {**doc, "stream": stream}, field, named)
                    assert status in (200, 400), (doc, status)
                    seen.add(status)
            assert seen == {200, 400}, (field, seen)
        assert h.real_engine.ready()
        assert await greedy_text(h) == before


# vLLM's and llama.cpp's structured outputs (api/structured.py), on both routes: 200 when unset,
# else a 400 naming the field (this test model has no grammar tokenizer: a well-formed constraint
# is refused naming it too, after its own checks).
STRUCTURED_FIELDS: dict[str, list[Any]] = {
    "guided_regex": [None, "a+", "x" * 4097, "a{1000}{1000}", 2**63, [], "(unclosed"],
    "guided_choice": [None, ["a"], [], [""], ["x" * 1025], [str(i) for i in range(257)], "a",
                      [2**63], [None]],
    "guided_grammar": [None, 'root ::= "a"', "x" * 65537, "root ::= ((", 2**63],
    "guided_json": [None, {"type": "object"}, "{not json", 2**63, [], _nested(16)],
    "guided_decoding_backend": [None, "xgrammar", 2**63],
    "structured_outputs": [None, {}, {"regex": "a"}, {"choice": ["a"], "regex": "b"},
                           {"structural_tag": {}}, {"json_object": 2}, {"json_object": False},
                           {"grammar": ""}, [], "x", 2**63],
    "grammar": [None, 'root ::= "a"', "", "x" * 65537, 2**63],
    "json_schema": [None, {"type": "object"}, 3, "x", _nested(16)],
}


async def test_structured_fields_at_and_past_their_bounds() -> None:
    async with real_app(make_config()) as h:
        before = await greedy_text(h)
        for field, values in STRUCTURED_FIELDS.items():

            def named(err: dict[str, Any], field: str = field) -> bool:
                # named as sent (`structured_outputs.regex`, `guided_choice[1]`, ...)
                return err["param"] is not None and bool(err["param"].startswith(field))

            seen = set()
            for v in values:
                for path, doc in ((C, {"prompt": "hi"}),
                                  (CH, {"messages": [{"role": "user", "content": "hi"}]})):
                    for stream in (False, True):
                        req = {**doc, "max_tokens": 3, field: v, "stream": stream}
                        seen.add(await expect_bounded(h, path, req, field, named))
            assert seen == {200, 400}, (field, seen)
        assert h.real_engine.ready()
        assert await greedy_text(h) == before
