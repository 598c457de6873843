"""``POST /v1/responses`` (api/responses.py, api/responses_stream.py): the chat request a Responses
body means, refusals naming the Responses field, the stream's events adding up to the unstreamed
response whatever the pieces (plain, a thinking model's, Hermes tool calls, cut short), and the
route end to end on the real engine (the openai client against a real server:
tests/e2e/test_responses_openai.py)."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from calserve import errors as E
from calserve.api.reasoning import Answer, Reasoning
from calserve.api.responses import (
    ResponsesBody, chat_body, json_response, responses_param,
)
from calserve.api.responses_stream import ResponsesStreamEncoder
from calserve.api.tools import parse_tools
from calserve.engine.types import ErrorEvent, FinishEvent, FinishReason, TokenEvent, Usage

from .conftest import make_config
from .real_engine import api_source, real_app
from .test_reasoning import PIECES
from .test_tool_stream import cut, feed
from .test_tools_hermes import PARIS, TOOLS


def body(**kw: Any) -> ResponsesBody:
    return msgspec.convert({"input": "Hi", **kw}, ResponsesBody)


def test_input_items_become_the_chat_turns() -> None:
    chat, echo = chat_body(body(instructions="Be brief.", input=[
        {"role": "developer", "content": "Use tools."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather "},
                                                        {"type": "input_text", "text": "in Paris?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "Let me look."}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather",
         "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "c2", "name": "now", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "c2", "output": "noon"},
        {"type": "function_call", "call_id": "c3", "name": "now", "arguments": "{}"},
    ]))
    got = [(m.role, m.content, m.tool_call_id,
            [c["id"] for c in m.tool_calls] if m.tool_calls else None) for m in chat.messages]
    assert got == [("system", "Be brief.", None, None), ("system", "Use tools.", None, None),
                   ("user", "Weather in Paris?", None, None),
                   ("assistant", "Let me look.", None, ["c1", "c2"]),
                   ("tool", "sunny", "c1", None), ("tool", "noon", "c2", None),
                   ("assistant", None, None, ["c3"])]
    assert echo.sources == ("instructions", "input[0]", "input[1]", "input[3]", "input[6]",
                            "input[7]", "input[8]")
    assert chat.messages[3].tool_calls[0]["function"] == {"name": "get_weather",
                                                         "arguments": '{"city": "Paris"}'}


def test_the_other_fields_become_the_chat_fields() -> None:
    tool = {"type": "function", "name": "get_weather", "description": "d",
            "parameters": {"type": "object"}, "strict": True}
    fmt = {"type": "json_schema", "name": "x", "schema": {"type": "object"}, "strict": True}
    chat, echo = chat_body(body(tools=[tool], tool_choice={"type": "function", "name": "get_weather"},
                                max_output_tokens=7, temperature=0.5, top_p=0.9, seed=3,
                                text={"format": fmt}, parallel_tool_calls=False, store=True,
                                metadata={"k": "v"}, user="u"))
    assert chat.tools == [{"type": "function", "function": {k: v for k, v in tool.items()
                                                            if k != "type"}}]
    assert chat.tool_choice == {"type": "function", "function": {"name": "get_weather"}}
    assert chat.response_format == {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object"}, "strict": True}}
    assert (chat.max_completion_tokens, chat.temperature, chat.top_p, chat.seed) == (7, 0.5, 0.9, 3)
    assert chat.parallel_tool_calls is False and chat.user == "u"
    assert echo.text == {"format": fmt} and echo.metadata == {"k": "v"} and echo.tools == [tool]
    assert chat_body(body())[1].text == {"format": {"type": "text"}}


@pytest.mark.parametrize(("fields", "param"), [
    ({"conversation": "conv_1"}, "conversation"),
    ({"background": True}, "background"),
    ({"include": ["reasoning.encrypted_content", "code_interpreter_call.outputs"]}, "include[1]"),
    ({"truncation": "auto"}, "truncation"),
    ({"max_tool_calls": 2}, "max_tool_calls"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tool_choice": {"type": "allowed_tools", "tools": []}}, "tool_choice"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"role": "user", "content": "a"}, {"type": "item_reference", "id": "x"}]},
     "input[1].type"),
    ({"input": [{"role": "critic", "content": "a"}]}, "input[0].role"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
     "input[0].call_id"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input"),
])
def test_what_is_not_served_is_a_400_naming_the_field(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(E.RequestError) as ei:
        chat_body(body(**fields))
    assert ei.value.param == param, ei.value.message


def test_chat_fields_named_as_the_responses_fields() -> None:
    src = ("instructions", "input[0]", "input[2]")
    assert responses_param("messages[2].content", src) == "input[2]"
    assert responses_param("messages[0]", src) == "instructions"
    assert responses_param("messages", src) == "input"
    assert responses_param("max_completion_tokens", src) == "max_output_tokens"
    assert responses_param("response_format.json_schema.schema", src) == "text.format.schema"
    assert responses_param("response_format", src) == "text.format"
    assert responses_param("tools[1].function.parameters", src) == "tools[1].parameters"
    assert responses_param("tool_choice", src) == "tool_choice"
    assert responses_param(None, src) is None


# ------------------------------------------------------------------------------ the stream
def events(raw: bytes) -> list[dict[str, Any]]:
    out = []
    for block in raw.decode().split("\n\n"):
        if not block:
            continue
        head, data = block.split("\n", 1)
        ev = json.loads(data.removeprefix("data: "))
        assert head == "event: " + ev["type"]
        out.append(ev)
    return out


def run_stream(pieces: list[str], answer: Answer | None, finish: FinishReason) -> list[dict[str, Any]]:
    _, echo = chat_body(body())
    return events(feed(ResponsesStreamEncoder("m", answer, echo), pieces, finish))


def check_events(evs: list[dict[str, Any]]) -> dict[str, Any]:
    """The event grammar; returns the final response, checked against the streamed items."""
    assert [e["sequence_number"] for e in evs] == list(range(len(evs)))
    assert [e["type"] for e in evs[:2]] == ["response.created", "response.in_progress"]
    final = evs[-1]
    assert final["type"] in ("response.completed", "response.incomplete")
    resp = final["response"]
    assert resp["status"] == final["type"].removeprefix("response.")
    items: dict[int, dict[str, Any]] = {}
    texts: dict[int, str] = {}
    done: set[int] = set()
    for e in evs[2:-1]:
        t = e["type"]
        if t == "response.output_item.added":
            assert e["output_index"] == len(items) and done == set(items)  # one item at a time
            items[e["output_index"]] = e["item"]
            texts[e["output_index"]] = ""
        elif t in ("response.output_text.delta", "response.reasoning_text.delta",
                   "response.function_call_arguments.delta"):
            assert e["item_id"] == items[e["output_index"]]["id"]
            texts[e["output_index"]] += e["delta"]
        elif t == "response.output_item.done":
            i = e["output_index"]
            assert e["item"]["id"] == items[i]["id"] and i not in done
            items[i] = e["item"]
            done.add(i)
    assert [i["id"] for i in resp["output"]] == [items[k]["id"] for k in sorted(items)]
    assert resp["output"] == [items[k] for k in sorted(items)]
    for k, item in items.items():  # the deltas add up to each item's final text
        if item["type"] == "function_call":
            assert texts[k] == item["arguments"]
        else:
            assert texts[k] == "".join(c["text"] for c in item["content"])
    return resp


def test_a_call_streams_as_it_is_written() -> None:
    """A call's item begins once its name is whole and its arguments stream as they come, each
    call's item done before the next begins; the response holds the streamed items."""
    tools = parse_tools(TOOLS, None, None, "hermes")
    two = "Sure.\n" + PARIS + "\n" + PARIS
    at = [two.index("Paris"), two.index("Paris") + 3, two.rindex("Paris") + 2]
    enc = ResponsesStreamEncoder("m", Answer(tools), chat_body(body())[1])
    out = enc.opening()
    kinds = []
    for piece in cut(two, at):
        raw = enc.encode([TokenEvent((1,), piece)])
        kinds.append([e["type"] for e in events(raw)] if raw else [])
        out += raw
    assert "response.function_call_arguments.delta" in kinds[0]  # '{"city": "' so far
    assert kinds[1] == ["response.function_call_arguments.delta"]  # "Par"
    assert "response.function_call_arguments.done" in kinds[2]  # the first call, done
    resp = check_events(events(out + enc.encode([FinishEvent(FinishReason.STOP, Usage(3, 4))])))
    assert [(i["type"], i.get("arguments")) for i in resp["output"]] == [
        ("message", None), ("function_call", '{"city": "Paris"}'),
        ("function_call", '{"city": "Paris"}')]
    assert resp["status"] == "completed"


def strip_ids(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The items without their ids (each answer draws new ones; a call's too)."""
    return [{k: v for k, v in i.items() if k not in ("id", "call_id")} for i in output]


@settings(max_examples=300, deadline=None)
@given(st.lists(PIECES, max_size=10), st.sampled_from(["plain", "think", "opened", "tools",
                                                       "think+tools"]),
       st.sampled_from(["", PARIS, PARIS + "\n" + PARIS]),
       st.lists(st.integers(0, 300), max_size=10), st.integers(0, 40))
def test_streamed_events_add_up_to_the_unstreamed_response(
        pieces: list[str], shape: str, calls: str, points: list[int], short: int) -> None:
    tools = parse_tools(TOOLS, None, None, "hermes") if "tools" in shape else None
    reasoning = None if shape in ("plain", "tools") else Reasoning(shape == "opened")
    answer = None if tools is None and reasoning is None else Answer(tools, reasoning)
    text = "".join(pieces) + (calls if tools is not None else "")
    finish = FinishReason.STOP
    if short:
        text, finish = text[:max(0, len(text) - short)], FinishReason.LENGTH
    resp = check_events(run_stream(cut(text, points), answer, finish))
    fr = "length" if finish is FinishReason.LENGTH else "stop"
    msg, fr = (answer.message(text, fr) if answer is not None
               else ({"role": "assistant", "content": text}, fr))
    _, echo = chat_body(body())
    want = json_response(echo, "m", msg, fr, Usage(3, 1))
    assert strip_ids(resp["output"]) == strip_ids(want["output"])
    assert resp["status"] == want["status"]
    assert resp["usage"]["input_tokens"] == 3


@pytest.mark.parametrize("at", [[], [1], [1, 6], [3]])
def test_text_held_back_before_a_call_streams_before_it(at: list[int]) -> None:
    """Found by the ``long`` hypothesis profile (session 50): a thinking model's answer ``<`` then
    a call. The reasoning split held the ``<`` (it may begin ``<think>``) and the call began, so
    the ``<`` came out at the end, as a message item added while the call's item was open. The
    split now gives up what it held once the content is complete (the calls began)."""
    tools = parse_tools(TOOLS, None, None, "hermes")
    answer = Answer(tools, Reasoning(False))
    resp = check_events(run_stream(cut("<" + PARIS, at), answer, FinishReason.STOP))
    assert [i["type"] for i in resp["output"]] == ["message", "function_call"]
    assert resp["output"][0]["content"][0]["text"] == "<"
    want, _ = answer.message("<" + PARIS, "stop")
    assert want["content"] == "<" and len(want["tool_calls"]) == 1
    # the answer's own stream gives the "<" as content as soon as the call begins
    text = answer.stream()
    assert text.feed("<") == ("", "")
    assert text.feed(PARIS) == ("", "<") and text.take_calls()


def test_an_error_ends_the_stream_as_a_failed_response() -> None:
    _, echo = chat_body(body())
    enc = ResponsesStreamEncoder("m", None, echo)
    raw = enc.opening() + enc.encode([TokenEvent((1,), "Hel")])
    raw += enc.encode([ErrorEvent("the device failed", "unavailable")])
    evs = events(raw)
    assert evs[-1]["type"] == "response.failed" and enc.finished
    resp = evs[-1]["response"]
    assert resp["status"] == "failed" and resp["error"]["message"] == "the device failed"
    assert resp["output"][0]["status"] == "incomplete"
    assert resp["output"][0]["content"][0]["text"] == "Hel"


# ------------------------------------------------------------------------------ the route
async def test_responses_through_the_api() -> None:
    """The real engine (fake device): unstreamed and streamed give the same text at temperature
    0, cut at ``max_output_tokens`` (incomplete), usage counted; refusals name the field."""
    async with real_app(make_config(), sources=[api_source()]) as h:
        doc: dict[str, Any] = {"input": "Hi", "max_output_tokens": 6, "temperature": 0,
                               "instructions": "Be brief."}
        status, resp, _ = await h.post("/v1/responses", doc)
        assert status == 200, resp
        assert resp["object"] == "response" and resp["status"] == "incomplete"
        assert resp["incomplete_details"] == {"reason": "max_output_tokens"}
        (item,) = resp["output"]
        text = item["content"][0]["text"]
        assert item["type"] == "message" and text
        u = resp["usage"]
        assert u["output_tokens"] == 6 and u["total_tokens"] == u["input_tokens"] + 6
        status, raw, _ = await h.post("/v1/responses", {**doc, "stream": True})
        assert status == 200
        streamed = check_events(events(raw))
        assert strip_ids(streamed["output"]) == strip_ids(resp["output"])
        assert streamed["usage"] == resp["usage"]
        # logprobs (include): on the text part and on each delta, the same either way
        lp_doc = {**doc, "include": ["message.output_text.logprobs"], "top_logprobs": 2}
        status, resp, _ = await h.post("/v1/responses", lp_doc)
        assert status == 200, resp
        lps = resp["output"][0]["content"][0]["logprobs"]
        assert len(lps) == 6 and all(len(x["top_logprobs"]) == 2 for x in lps), lps
        assert "".join(x["token"] for x in lps) == resp["output"][0]["content"][0]["text"]
        status, raw, _ = await h.post("/v1/responses", {**lp_doc, "stream": True})
        evs = events(raw)
        streamed = check_events(evs)
        deltas = [x for e in evs if e["type"] == "response.output_text.delta" for x in e["logprobs"]]
        assert deltas == lps == streamed["output"][0]["content"][0]["logprobs"]
        status, err, _ = await h.post("/v1/responses", {**doc, "include": ["file_search_call.results"]})
        assert status == 400 and err["error"]["param"] == "include[0]", err
        status, err, _ = await h.post("/v1/responses", {**doc, "max_output_tokens": 100000})
        assert status == 400 and err["error"]["param"] == "max_output_tokens", err
        bad_tool = {"type": "function", "name": "not a name!", "parameters": {}}
        status, err, _ = await h.post("/v1/responses", {**doc, "tools": [bad_tool]})
        assert status == 400 and err["error"]["param"] == "tools[0].name", err
        assert ".function" not in err["error"]["message"], err
        status, err, _ = await h.post("/v1/responses", {**doc, "previous_response_id": "r"})
        assert status == 400 and err["error"]["param"] == "previous_response_id", err
        status, err, _ = await h.post("/v1/responses", {"max_output_tokens": 3})
        assert status == 400 and err["error"]["param"] == "input", err
        status, err, _ = await h.post("/v1/responses", {**doc, "model": "nope"})
        assert status == 404 and err["error"]["param"] == "model", err


async def test_a_codex_style_request() -> None:
    """What Codex-style clients send: ``store: false``, ``include:
    ["reasoning.encrypted_content"]`` (the reasoning to send back as an opaque blob), reasoning
    options, earlier reasoning items with their ``encrypted_content``: served, streamed and not;
    a reasoning item's ``encrypted_content`` is null (nothing hidden), and an earlier one sent back
    changes nothing (reasoning items are dropped)."""
    async with real_app(make_config(), sources=[api_source()]) as h:
        base: dict[str, Any] = {"max_output_tokens": 4, "temperature": 0, "store": False,
                                "include": ["reasoning.encrypted_content"],
                                "reasoning": {"effort": "medium", "summary": "auto"},
                                "parallel_tool_calls": False}
        plain = await h.post_ok("/v1/responses", {**base, "input": "Hi"})
        assert plain["store"] is False
        earlier = {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "opaque"}
        doc = {**base, "input": [{"role": "user", "content": "Hi"}, earlier]}
        again = await h.post_ok("/v1/responses", doc)
        assert again["output"][0]["content"] == plain["output"][0]["content"]
        assert again["usage"] == plain["usage"]
        status, raw, _ = await h.post("/v1/responses", {**doc, "stream": True})
        assert status == 200
        assert strip_ids(check_events(events(raw))["output"]) == strip_ids(again["output"])
    item = json_response(chat_body(body())[1], "m", {"role": "assistant", "content": "x",
                                                     "reasoning_content": "thought"}, "stop",
                         Usage(1, 1))["output"][0]
    assert item["type"] == "reasoning" and item["encrypted_content"] is None
