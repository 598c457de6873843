"""Tool calling through the official openai client against a real server (the demo package on the
software runtime; api/tools.py): ``tools`` with ``tool_choice`` auto / required / one function,
``parallel_tool_calls``, streamed and not, ``n`` choices, and a conversation that carries earlier
calls and their results.

The demo model's text is noise, which makes this the grammar's test: every call must name a tool
of the request and its arguments must validate against that tool's ``parameters``, whatever the
model would have written (SmolLM2 answering a real question: tests/e2e/test_smollm2.py)."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pytest

from .openai_stream import streamed
from .server import ServerProcess

PARAMS: list[Any] = [
    {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                      "unit": {"enum": ["celsius", "fahrenheit"]}},
     "required": ["city"]},
    {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "number"},
                                      "tags": {"type": "array", "items": {"type": "boolean"},
                                               "maxItems": 3}},
     "required": ["a", "b"]},
    {"type": "object", "properties": {}},
]
TOOLS: Any = [{"type": "function", "function": {"name": n, "description": d, "parameters": p}}
              for n, d, p in zip(("get_weather", "add", "now"),
                                 ("The weather in a city", "Adds a and b", "The time"), PARAMS)]
BY_NAME = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MSGS: Any = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def check_calls(calls: Any, only: str | None = None) -> list[tuple[str, Any]]:
    """Every call names a tool and its arguments validate; returns (name, arguments)."""
    assert calls, "no tool call"
    out = []
    for c in calls:
        assert c.type == "function" and c.id.startswith("call_")
        name = c.function.name
        assert name in BY_NAME and (only is None or name == only), name
        args = json.loads(c.function.arguments)
        jsonschema.validate(args, BY_NAME[name])
        out.append((name, args))
    return out


def test_required_and_named_answers_are_valid_calls(client: openai.OpenAI) -> None:
    for seed in range(6):
        for choice, only in (("required", None),
                             ({"type": "function", "function": {"name": "add"}}, "add")):
            r = client.chat.completions.create(model="qwen3", messages=MSGS, tools=TOOLS,
                                               tool_choice=choice, seed=seed, temperature=1.0,
                                               max_tokens=300)
            c = r.choices[0]
            assert c.finish_reason == "tool_calls", c
            assert c.message.content is None
            check_calls(c.message.tool_calls, only)


def test_auto_answers_call_or_reply(client: openai.OpenAI) -> None:
    kinds = set()
    for seed in range(10):
        r = client.chat.completions.create(model="qwen3", messages=MSGS, tools=TOOLS, seed=seed,
                                           temperature=1.0, max_tokens=300)
        c = r.choices[0]
        if c.message.tool_calls:
            assert c.finish_reason == "tool_calls"
            check_calls(c.message.tool_calls)
            kinds.add("call")
        else:  # a reply: complete, or the noise model's text cut at max_tokens (its text so far)
            assert c.finish_reason in ("stop", "length") and isinstance(c.message.content, str), c
            assert not c.message.content.startswith('{"response"'), c
            kinds.add("reply")
    assert kinds  # either is the model's choice; both are well-formed


def test_one_call_when_parallel_calls_are_off(client: openai.OpenAI) -> None:
    for seed in range(6):
        r = client.chat.completions.create(model="qwen3", messages=MSGS, tools=TOOLS, seed=seed,
                                           tool_choice="required", parallel_tool_calls=False,
                                           temperature=1.0, max_tokens=300)
        assert len(check_calls(r.choices[0].message.tool_calls)) == 1


def test_streamed_calls_equal_the_answer_and_n_choices(client: openai.OpenAI) -> None:
    kw: Any = {"model": "qwen3", "messages": MSGS, "tools": TOOLS, "tool_choice": "required",
               "seed": 4, "temperature": 1.0, "max_tokens": 300, "n": 2}
    r = client.chat.completions.create(**kw)
    want = {c.index: check_calls(c.message.tool_calls) for c in r.choices}
    assert sorted(want) == [0, 1]
    got: dict[int, dict[int, list[str]]] = {}
    finish: dict[int, str] = {}
    usage = None
    for ch in client.chat.completions.create(**kw, stream=True,
                                             stream_options={"include_usage": True}):
        usage = ch.usage or usage
        for c in ch.choices:
            for tc in c.delta.tool_calls or []:
                slot = got.setdefault(c.index, {}).setdefault(tc.index, ["", ""])
                slot[0] += (tc.function.name or "") if tc.function else ""
                slot[1] += (tc.function.arguments or "") if tc.function else ""
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert finish == {0: "tool_calls", 1: "tool_calls"}
    assert {i: [(n, json.loads(a)) for n, a in calls.values()] for i, calls in got.items()} == want
    assert usage is not None and r.usage is not None
    assert usage.completion_tokens == r.usage.completion_tokens


def test_a_conversation_with_earlier_calls_and_results(client: openai.OpenAI) -> None:
    msgs: Any = [
        *MSGS,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"},
    ]
    r = client.chat.completions.create(model="qwen3", messages=msgs, tools=TOOLS, seed=1,
                                       max_tokens=300)
    c = r.choices[0]
    assert c.finish_reason in ("tool_calls", "stop")
    if c.message.tool_calls:
        check_calls(c.message.tool_calls)
    # without tools in this request, the earlier turns are still read (a plain answer)
    r = client.chat.completions.create(model="qwen3", messages=msgs, seed=1, max_tokens=5)
    assert r.choices[0].message.tool_calls is None


def test_bad_tools_are_400s_naming_the_field(client: openai.OpenAI) -> None:
    for tools, choice, param in (
            ([{"type": "function", "function": {"name": "no spaces"}}], None,
             "tools[0].function.name"),
            (TOOLS, {"type": "function", "function": {"name": "missing"}}, "tool_choice"),
            ([{"type": "function", "function": {"name": "f", "parameters": {"type": "objectx"}}}],
             None, "tools")):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="qwen3", messages=MSGS, tools=tools,
                                           tool_choice=choice or "auto", max_tokens=5)
        body: Any = e.value.body
        assert body["param"] == param, body


def test_a_direct_answer_streams_as_text(client: openai.OpenAI) -> None:
    """tool_choice auto, streamed: a direct answer's text arrives as content deltas (never the
    JSON around it) and adds up to the unstreamed answer; calls as the openai library puts their
    deltas together are the unstreamed answer's, names and arguments' text (cut short at
    ``max_tokens`` too). (That text and arguments stream as they grow:
    tests/api/test_tool_stream.py; this model writes 40 tokens in a few ms.)"""
    seen = set()
    for seed in range(8):
        kw: Any = {"model": "qwen3", "messages": MSGS, "tools": TOOLS, "seed": seed,
                   "temperature": 1.0, "max_tokens": 40}
        r = client.chat.completions.create(**kw)
        want = r.choices[0]
        snapshot, _ = streamed(client, **kw)
        got = snapshot.choices[0]
        assert got.finish_reason == want.finish_reason
        if want.message.tool_calls:
            seen.add("call")
            assert [(c.function.name, c.function.arguments) for c in got.message.tool_calls or []
                    ] == [(c.function.name, c.function.arguments) for c in want.message.tool_calls]
        else:
            seen.add("text")
            assert got.message.content == want.message.content and not got.message.tool_calls
    assert seen


def test_pydantic_style_parameters_with_defs(client: openai.OpenAI) -> None:
    """Parameters as pydantic writes them (``$defs`` + ``$ref: "#/$defs/..."``, and a pointer into
    the schema itself): the calls validate against them as given."""
    coord = {"type": "integer", "minimum": -99, "maximum": 99}  # the noise model's numbers end
    point = {"type": "object", "properties": {"x": coord, "y": coord}, "required": ["x", "y"]}
    shape = {"type": "object", "$defs": {"Point": point},
             "properties": {"corners": {"type": "array", "items": {"$ref": "#/$defs/Point"},
                                        "maxItems": 4},
                            "origin": {"$ref": "#/properties/corners/items"}},
             "required": ["corners", "origin"]}
    tools: Any = [{"type": "function", "function": {"name": "draw", "parameters": shape}}]
    for seed in range(4):
        r = client.chat.completions.create(model="qwen3", messages=MSGS, tools=tools, seed=seed,
                                           tool_choice="required", temperature=1.0,
                                           parallel_tool_calls=False, max_tokens=400)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls", c
        for call in c.message.tool_calls or []:
            jsonschema.validate(json.loads(call.function.arguments), shape)


def test_tokenize_renders_the_prompt_a_request_with_tools_uses(client: openai.OpenAI,
                                                              server: ServerProcess) -> None:
    """``/tokenize`` with ``messages`` and ``tools`` gives the prompt the chat request renders:
    its count is the request's ``usage.prompt_tokens``."""
    import httpx

    body = {"model": "qwen3", "messages": MSGS, "tools": TOOLS}
    tok = httpx.post(server.url + "/tokenize", json=body, timeout=30).json()
    plain = httpx.post(server.url + "/tokenize", json={**body, "tools": None}, timeout=30).json()
    assert '"get_weather"' in tok["prompt"] and '"get_weather"' not in plain["prompt"]
    r = client.chat.completions.create(model="qwen3", messages=MSGS, tools=TOOLS, max_tokens=1,
                                       seed=0)
    assert r.usage is not None and r.usage.prompt_tokens == tok["count"]
    bad = httpx.post(server.url + "/tokenize", json={"prompt": "x", "tools": TOOLS}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tools"
