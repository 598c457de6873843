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


def test_calls_come_whole_with_the_finish() -> None:
    answer = '{"tool_calls":[{"name":"now","arguments":{}},{"name":"add","arguments":{"a":2}}]}'
    pieces = cut(answer, [3, 10, 30, 50])
    raw, enc = stream(pieces)
    ev = events(raw)
    ds = deltas(raw)
    assert ds[0][0]["role"] == "assistant"
    calls = [d for d, _ in ds if "tool_calls" in d]
    assert len(calls) == 1 and ds[-1] == ({}, "tool_calls")
    got = calls[0]["tool_calls"]
    assert [(c["index"], c["type"], c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in got] == [(0, "function", "now", {}), (1, "function", "add", {"a": 2})]
    assert all(c["id"].startswith("call_") for c in got)
    assert ev[-1]["choices"] == [] and ev[-1]["usage"]["total_tokens"] == 3 + len(pieces)
    assert all(e.get("usage", "absent") is None for e in ev[:-1])
    assert isinstance(enc.terminal, FinishEvent)


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
