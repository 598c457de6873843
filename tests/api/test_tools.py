"""Tool calling's pure parts (api/tools.py): what a request's ``tools`` / ``tool_choice`` become,
the schema the answer is held to, the prompt's instructions and earlier turns, and the answer read
back into OpenAI's message (the served path: tests/e2e/test_tools_openai.py)."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from calserve import errors as E
from calserve.api.tools import MAX_PARALLEL_CALLS, MAX_TOOLS, parse_tools, tool_messages

WEATHER = {"type": "object", "properties": {"city": {"type": "string"},
                                            "unit": {"enum": ["c", "f"]}}, "required": ["city"]}


def tool(name: str, parameters: Any = None, **more: Any) -> dict[str, Any]:
    f: dict[str, Any] = {"name": name, **more}
    if parameters is not None:
        f["parameters"] = parameters
    return {"type": "function", "function": f}


TOOLS = [tool("get_weather", WEATHER, description="weather"), tool("now")]


def valid(schema: Any, value: Any) -> bool:
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError:
        return False
    return True


def test_no_tools_or_choice_none_calls_nothing() -> None:
    assert parse_tools(None, None, None) is None
    assert parse_tools(None, "auto", None) is None
    assert parse_tools(TOOLS, "none", None) is None
    with pytest.raises(E.RequestError) as e:
        parse_tools(None, "required", None)
    assert e.value.param == "tool_choice"


def test_modes_and_the_answer_schema() -> None:
    auto = parse_tools(TOOLS, None, None)
    assert auto is not None and auto.mode == "auto" and auto.parallel
    s = auto.schema()
    call = {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}
    assert valid(s, call)
    assert valid(s, {"response": "hi"})
    assert valid(s, {"tool_calls": [{"name": "now", "arguments": {}}] * 3})
    assert not valid(s, {"tool_calls": []})
    assert not valid(s, {"tool_calls": [{"name": "other", "arguments": {}}]})
    assert not valid(s, {"tool_calls": [{"name": "get_weather", "arguments": {}}]})  # city
    # a tool's object schemas are closed unless they say otherwise
    assert not valid(s, {"tool_calls": [{"name": "get_weather",
                                         "arguments": {"city": "x", "extra": 1}}]})
    assert not valid(s, {"tool_calls": [{"name": "now", "arguments": {"x": 1}}]})
    req = parse_tools(TOOLS, "required", False)
    assert req is not None and req.forced is None and not req.parallel
    assert valid(req.schema(), call)
    assert not valid(req.schema(), {"response": "hi"})
    assert not valid(req.schema(), {"tool_calls": call["tool_calls"] * 2})  # parallel off
    named = parse_tools(TOOLS, {"type": "function", "function": {"name": "now"}}, None)
    assert named is not None and named.forced == "now"
    assert valid(named.schema(), {"tool_calls": [{"name": "now", "arguments": {}}]})
    assert not valid(named.schema(), call)
    big = parse_tools(TOOLS, "required", True)
    assert big is not None
    assert not valid(big.schema(), {"tool_calls": call["tool_calls"] * (MAX_PARALLEL_CALLS + 1)})


def test_a_schema_that_allows_more_keeps_allowing_them() -> None:
    open_ = {"type": "object", "properties": {"a": {"type": "integer"}},
             "additionalProperties": True}
    t = parse_tools([tool("f", open_)], "required", None)
    assert t is not None
    assert valid(t.schema(), {"tool_calls": [{"name": "f", "arguments": {"a": 1, "b": 2}}]})
    assert t.tools[0]["parameters"] == open_


@pytest.mark.parametrize("tools,choice,param", [
    ("x", None, "tools"),
    ([], None, "tools"),
    ([tool("f")] * (MAX_TOOLS + 1), None, "tools"),
    ([{"type": "retrieval"}], None, "tools[0].type"),
    ([{"type": "function"}], None, "tools[0].function"),
    ([tool("")], None, "tools[0].function.name"),
    ([tool("x" * 65)], None, "tools[0].function.name"),
    ([tool("a.b")], None, "tools[0].function.name"),
    ([tool("f"), tool("g"), tool("f")], None, "tools[2].function.name"),
    ([tool("f", description="d" * 4097)], None, "tools[0].function.description"),
    ([tool("f", parameters="object")], None, "tools[0].function.parameters"),
    ([tool("f", strict="yes")], None, "tools[0].function.strict"),
    ([tool("f")], "any", "tool_choice"),
    ([tool("f")], {"type": "function", "function": {"name": "g"}}, "tool_choice"),
    ([tool("f")], {"type": "function"}, "tool_choice"),
    ([tool("f")], 3, "tool_choice"),
])
def test_bad_tools_name_the_field(tools: Any, choice: Any, param: str) -> None:
    with pytest.raises(E.RequestError) as e:
        parse_tools(tools, choice, None)
    assert e.value.param == param, e.value.message


def test_instructions_go_into_the_system_message() -> None:
    t = parse_tools(TOOLS, None, None)
    assert t is not None
    user = [{"role": "user", "content": "hi"}]
    first = t.with_instructions(user)
    assert first[0]["role"] == "system" and first[1:] == user
    assert '"get_weather"' in first[0]["content"] and '"response"' in first[0]["content"]
    kept = t.with_instructions([{"role": "system", "content": "Be brief."}, *user])
    assert kept[0]["content"].startswith("Be brief.\n\n") and kept[1:] == user
    forced = parse_tools(TOOLS, {"type": "function", "function": {"name": "now"}}, False)
    assert forced is not None
    text = forced.instructions()
    assert "`now`" in text and "at most one tool" in text and '"response"' not in text


def test_answers_become_openai_messages() -> None:
    t = parse_tools(TOOLS, None, None)
    assert t is not None
    calls = {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Zürich"}},
                            {"name": "now", "arguments": {}}]}
    text = json.dumps(calls, ensure_ascii=False, separators=(",", ":"))  # as the grammar writes
    msg, fr = t.message(text, "stop")
    assert fr == "tool_calls" and msg["content"] is None
    got = msg["tool_calls"]
    assert [c["type"] for c in got] == ["function"] * 2
    assert len({c["id"] for c in got}) == 2 and all(c["id"].startswith("call_") for c in got)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got] == [
        ("get_weather", {"city": "Zürich"}), ("now", {})]
    # the arguments' text as the model wrote it
    assert [c["function"]["arguments"] for c in got] == ['{"city":"Zürich"}', "{}"]
    assert t.message('{"response":"Hello \\"you\\""}', "stop") == (
        {"role": "assistant", "content": 'Hello "you"'}, "stop")
    # cut short: the direct answer's text so far; a call not named yet as generated; the calls
    # named so far, the last one's arguments cut short (as OpenAI returns them)
    assert t.message('{"response":"Hel', "length") == ({"role": "assistant", "content": "Hel"},
                                                        "length")
    assert t.message('{"response":"a\\u00', "length")[0]["content"] == "a"
    assert t.message('{"response":"a\\', "length")[0]["content"] == "a"
    cut = '{"tool_calls":[{"name":"now","argu'
    assert t.message(cut, "length") == ({"role": "assistant", "content": cut}, "length")
    msg, fr = t.message(text[:text.index("Zü") + 1], "length")
    assert fr == "length" and msg["content"] is None
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in msg["tool_calls"]] == [
        ("get_weather", '{"city":"Z')]
    # complete calls that ended otherwise (a stop string, max_tokens on the closing bracket)
    # keep their finish reason
    assert t.message(text, "length")[1] == "length"
    msg, fr = t.message(text[:-1], "stop")
    assert fr == "stop" and len(msg["tool_calls"]) == 2


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=40), st.integers(min_value=0, max_value=12))
def test_a_cut_direct_answer_is_a_prefix_of_the_whole(text: str, cut: int) -> None:
    t = parse_tools(TOOLS, None, None)
    assert t is not None
    whole = json.dumps({"response": text}, ensure_ascii=False, separators=(",", ":"))
    assert t.message(whole, "stop")[0]["content"] == text
    part = whole[:max(len('{"response":"'), len(whole) - 2 - cut)]
    got = t.message(part, "length")[0]["content"]
    assert text.startswith(got)


def test_earlier_turns_are_shown_as_the_format() -> None:
    asked = tool_messages("assistant", "", [{"id": "c1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris"}'}}], None, "messages[1]")
    assert asked["role"] == "assistant"
    assert json.loads(asked["content"]) == {
        "tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}
    answered = tool_messages("tool", "18 C", None, "c1", "messages[2]")
    assert answered["role"] == "user"
    assert json.loads(answered["content"]) == {
        "tool_response": {"tool_call_id": "c1", "content": "18 C"}}
    for calls, param in ((None, "messages[1].tool_calls"), ({}, "messages[1].tool_calls"),
                         ([{"function": {"name": "f"}}], "messages[1].tool_calls[0].function"),
                         (["x"], "messages[1].tool_calls[0].function")):
        with pytest.raises(E.RequestError) as e:
            tool_messages("assistant", "", calls, None, "messages[1]")
        assert e.value.param == param



def test_parallel_results_are_one_user_turn() -> None:
    from calserve.api.chat_prompt import chat_messages
    from calserve.api.schemas import ChatMessage

    call = {"id": "c1", "type": "function", "function": {"name": "now", "arguments": "{}"}}
    msgs = chat_messages([
        ChatMessage(role="user", content="time twice?"),
        ChatMessage(role="assistant", tool_calls=[call, {**call, "id": "c2"}]),
        ChatMessage(role="tool", content="10:00", tool_call_id="c1"),
        ChatMessage(role="tool", content="10:01", tool_call_id="c2"),
        ChatMessage(role="user", content="thanks"),
    ])
    assert [m["role"] for m in msgs] == ["user", "assistant", "user", "user"]
    results = [json.loads(line) for line in msgs[2]["content"].split("\n")]
    assert results == [{"tool_response": {"tool_call_id": "c1", "content": "10:00"}},
                       {"tool_response": {"tool_call_id": "c2", "content": "10:01"}}]


def test_parameters_that_refer_into_themselves() -> None:
    """pydantic writes nested models as ``$defs`` and ``$ref: "#/$defs/Model"``; a recursive one
    refers to ``#``. Inside the answer's schema they mean what they meant alone."""
    point = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    shape = {"type": "object", "$defs": {"Point": point},
             "properties": {"corners": {"type": "array", "items": {"$ref": "#/$defs/Point"}},
                            "origin": {"$ref": "#/properties/corners/items"}},
             "required": ["corners"]}
    tree = {"type": "object", "properties": {"v": {"type": "integer"},
                                             "kids": {"type": "array", "items": {"$ref": "#"}}},
            "required": ["v"]}
    t = parse_tools([tool("shape", shape), tool("tree", tree)], "required", None)
    assert t is not None
    s = t.schema()

    def ok(name: str, args: Any) -> bool:
        return valid(s, {"tool_calls": [{"name": name, "arguments": args}]})

    assert ok("shape", {"corners": [{"x": 1}, {"x": 2}], "origin": {"x": 0}})
    assert not ok("shape", {"corners": [{"x": "a"}]})
    assert not ok("shape", {"corners": [], "origin": {"y": 1}})
    assert ok("tree", {"v": 1, "kids": [{"v": 2, "kids": []}, {"v": 3}]})
    assert not ok("tree", {"v": 1, "kids": [{"kids": []}]})
    assert not ok("tree", {"v": 1, "kids": [{"v": 2, "extra": 0}]})  # closed at every level


def test_no_parameters_means_no_arguments_and_odd_answers_stay_text() -> None:
    t = parse_tools([tool("now", {}), tool("ping")], "required", None)
    assert t is not None
    for name in ("now", "ping"):
        assert valid(t.schema(), {"tool_calls": [{"name": name, "arguments": {}}]})
        assert not valid(t.schema(), {"tool_calls": [{"name": name, "arguments": 5}]})
        assert not valid(t.schema(), {"tool_calls": [{"name": name, "arguments": {"a": 1}}]})
    for odd in ('{"tool_calls":[{"arguments":{}}]}', '{"tool_calls":[3]}', '{"tool_calls":[]}',
                '{"other":1}', "[1]"):
        assert t.message(odd, "stop") == ({"role": "assistant", "content": odd}, "stop")
