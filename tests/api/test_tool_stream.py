"""A chat answer with tools, streamed (api/tool_stream.py): a direct answer's text as it grows,
calls whole at the end, and the deltas adding up to the unstreamed message of the same answer."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from calserve.api.chunks import ChunkEncoder
from calserve.api.render import DONE
from calserve.api.reasoning import Answer
from calserve.api.tool_stream import ToolStreamEncoder
from calserve.api.tools import ResponseText, ToolCalling, parse_tools
from calserve.engine.types import ErrorEvent, FinishEvent, FinishReason, TokenEvent, Usage

TOOLS: Any = [{"type": "function", "function": {"name": "now"}},
              {"type": "function", "function": {"name": "add", "parameters": {
                  "type": "object", "properties": {"a": {"type": "integer"}}}}}]


def calling() -> ToolCalling:
    t = parse_tools(TOOLS, None, None)
    assert t is not None
    return t


def cut(text: str, points: list[int]) -> list[str]:
    """``text`` in pieces at ``points`` (positions taken modulo its length)."""
    at = sorted({p % (len(text) + 1) for p in points} | {0, len(text)})
    return [text[a:b] for a, b in zip(at, at[1:])]


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=60), st.booleans(), st.lists(st.integers(0, 200), max_size=12))
def test_a_direct_answer_streams_its_text_whatever_the_pieces(text: str, ascii_: bool,
                                                              points: list[int]) -> None:
    answer = json.dumps({"response": text}, ensure_ascii=ascii_, separators=(",", ":"))
    r = ResponseText()
    got = "".join(r.feed(p) for p in cut(answer, points))
    assert got == text and r.mode == "text" and r.done
    # never half of a surrogate pair: every piece encodes on its own
    for piece in r.sent:
        piece.encode("utf-8")


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 200), max_size=12))
def test_calls_stream_nothing_until_the_end(points: list[int]) -> None:
    answer = json.dumps({"tool_calls": [{"name": "add", "arguments": {"a": 1}}]},
                        separators=(",", ":"))
    r = ResponseText()
    assert "".join(r.feed(p) for p in cut(answer, points)) == "" and r.mode == "calls"


def events(raw: bytes) -> list[Any]:
    out = []
    for block in raw.split(b"\n\n"):
        if block and block != DONE.strip():
            assert block.startswith(b"data: ")
            out.append(json.loads(block[6:]))
    return out


def stream(pieces: list[str], finish: FinishReason = FinishReason.STOP, last: bool = True,
           usage: bool = True) -> tuple[bytes, ToolStreamEncoder]:
    enc = ToolStreamEncoder(ChunkEncoder(chat=True, rid="chatcmpl-1", created=1, model="m",
                                         include_usage=usage), Answer(calling()),
                            include_usage=usage, logprobs=None, last=last)
    return feed(enc, pieces, finish), enc


def feed(enc: Any, pieces: list[str], finish: FinishReason) -> bytes:
    """The whole stream of ``enc`` (an SSE encoder) for an answer in ``pieces`` then ``finish``."""
    out: bytes = enc.opening()
    for p in pieces:
        out += enc.encode([TokenEvent((1,), p)])
        assert not enc.finished
    out += enc.encode([FinishEvent(finish, Usage(3, len(pieces)))])
    assert enc.finished
    return out


def deltas(raw: bytes) -> list[tuple[dict[str, Any], str | None]]:
    return [(c["delta"], c["finish_reason"]) for e in events(raw) for c in e["choices"]]


@settings(max_examples=150, deadline=None)
@given(st.text(max_size=40), st.lists(st.integers(0, 100), max_size=8), st.booleans())
def test_streamed_deltas_add_up_to_the_message(text: str, points: list[int], cut_short: bool
                                               ) -> None:
    answer = json.dumps({"response": text}, ensure_ascii=False, separators=(",", ":"))
    if cut_short:
        answer = answer[:max(1, len(answer) - 1 - len(points))]
    finish = FinishReason.LENGTH if cut_short else FinishReason.STOP
    raw, _ = stream(cut(answer, points), finish)
    assert raw.endswith(DONE)
    ds = deltas(raw)
    assert ds[0] == ({"role": "assistant", "content": ""}, None)
    content = "".join(d.get("content", "") for d, _ in ds[1:])
    want, fr = calling().message(answer, "length" if cut_short else "stop")
    assert content == (want["content"] or "") and ds[-1] == ({}, fr)
    assert all("tool_calls" not in d for d, _ in ds)


def accumulate(ds: list[tuple[dict[str, Any], str | None]]) -> list[dict[str, Any]]:
    """The calls a client puts together from ``tool_calls`` deltas (as the openai library does):
    a call's first delta has its id, type and name, the next ones add to its arguments only."""
    calls: list[dict[str, Any]] = []
    for d, _ in ds:
        for c in d.get("tool_calls", []):
            k = c["index"]
            if k == len(calls):
                assert c["id"].startswith("call_") and c["type"] == "function", c
                calls.append({"id": c["id"], "name": c["function"]["name"],
                              "arguments": c["function"]["arguments"]})
            else:
                assert k == len(calls) - 1 and set(c) == {"index", "function"}, c
                assert set(c["function"]) == {"arguments"}, c
                calls[k]["arguments"] += c["function"]["arguments"]
    return calls


def wanted(msg: dict[str, Any]) -> list[tuple[str, str]]:
    return [(c["function"]["name"], c["function"]["arguments"]) for c in msg.get("tool_calls") or []]


def test_calls_stream_as_they_are_written() -> None:
    """A call's name comes once it is whole, its arguments' text piece by piece as the model
    writes it, before the answer ends; together they are the unstreamed message's calls."""
    answer = '{"tool_calls":[{"name":"now","arguments":{}},{"name":"add","arguments":{"a":21}}]}'
    at = answer.index('"a":2') + 5  # inside the second call's arguments
    named = answer.index("{}")  # the first call's name and its arguments' key whole
    pieces = [answer[:10], answer[10:named], answer[named:at], answer[at:]]
    enc = ToolStreamEncoder(ChunkEncoder(chat=True, rid="chatcmpl-1", created=1, model="m",
                                         include_usage=True), Answer(calling()),
                            include_usage=True, logprobs=None)
    out = enc.opening()
    so_far = []
    for p in pieces:
        out += enc.encode([TokenEvent((1,), p)])
        so_far.append([(c["name"], c["arguments"]) for c in accumulate(deltas(out))])
    assert so_far[0] == []  # not even the first call's name yet
    assert so_far[1] == [("now", "")]  # the name as soon as it is whole
    assert so_far[2] == [("now", "{}"), ("add", '{"a":2')]  # the arguments as they come
    assert so_far[3] == [("now", "{}"), ("add", '{"a":21}')]
    out += enc.encode([FinishEvent(FinishReason.STOP, Usage(3, 4))])
    ds = deltas(out)
    got = accumulate(ds)
    assert [(c["name"], c["arguments"]) for c in got] == [("now", "{}"), ("add", '{"a":21}')]
    assert ds[-1] == ({}, "tool_calls")
    want, fr = calling().message(answer, "stop")
    assert fr == "tool_calls" and wanted(want) == [("now", "{}"), ("add", '{"a":21}')]
    assert want["content"] is None and all("content" not in d or d["content"] == ""
                                           for d, _ in ds)
    ev = events(out)
    assert ev[-1]["choices"] == [] and ev[-1]["usage"]["total_tokens"] == 3 + 4
    assert all(e.get("usage", "absent") is None for e in ev[:-1])
    assert isinstance(enc.terminal, FinishEvent)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["now", "add"]),
                          st.dictionaries(st.sampled_from(["a", "b\"}", "{c"]),
                                          st.recursive(st.none() | st.booleans() | st.integers()
                                                       | st.text(max_size=6),
                                                       lambda v: st.lists(v, max_size=3),
                                                       max_leaves=6), max_size=3)),
                min_size=1, max_size=3),
       st.lists(st.integers(0, 300), max_size=10), st.integers(0, 30))
def test_streamed_calls_add_up_to_the_message_whatever_the_pieces(
        calls: list[tuple[str, dict[str, Any]]], points: list[int], short: int) -> None:
    answer = json.dumps({"tool_calls": [{"name": n, "arguments": a} for n, a in calls]},
                        ensure_ascii=False, separators=(",", ":"))
    finish = FinishReason.STOP
    if short:
        answer, finish = answer[:-short], FinishReason.LENGTH
    raw, _ = stream(cut(answer, points), finish)
    ds = deltas(raw)
    want, fr = calling().message(answer, "length" if short else "stop")
    assert ds[-1] == ({}, fr)
    got = accumulate(ds)
    assert [(c["name"], c["arguments"]) for c in got] == wanted(want)
    content = "".join(d.get("content", "") for d, _ in ds[1:])
    assert content == (want["content"] or "")
    if not short:  # whole: every call, its arguments as written
        assert fr == "tool_calls" and [(n, json.loads(a)) for n, a in wanted(want)] == calls
    elif want.get("tool_calls"):  # cut short: the calls so far, the last one's arguments cut
        assert fr == "length" and answer.startswith('{"tool_calls":[')


def test_one_choice_of_several_and_the_error_ends() -> None:
    raw, _ = stream(['{"response":"hi"}'], last=False, usage=False)
    assert not raw.endswith(DONE) and deltas(raw)[-1] == ({}, "stop")
    enc = ToolStreamEncoder(ChunkEncoder(chat=True, rid="r", created=1, model="m",
                                         include_usage=False), Answer(calling()),
                            include_usage=False, logprobs=None)
    out = enc.encode([TokenEvent((1,), '{"response":"par'),
                      ErrorEvent("device lost", "device_error")])
    assert enc.finished and isinstance(enc.terminal, ErrorEvent) and not out.endswith(DONE)
    ev = events(out)
    assert ev[0]["choices"][0]["delta"] == {"content": "par"} and "error" in ev[-1]
    empty = ToolStreamEncoder(ChunkEncoder(chat=True, rid="r", created=1, model="m",
                                           include_usage=False), Answer(calling()),
                              include_usage=False, logprobs=None)
    assert "error" in events(empty.encode([]))[0] and empty.finished


def test_text_that_is_not_json_stops_the_stream_instead_of_raising() -> None:
    r = ResponseText()
    assert r.feed('{"response":"ok ') == "ok "
    assert r.feed('a\\x b') == "" and r.mode == "calls"  # \x is no JSON escape
    assert r.feed("more") == "" and r.sent == ["ok "]
