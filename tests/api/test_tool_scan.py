"""The calls of an answer as its text grows (api/tool_scan.py): the same calls whatever the pieces,
the arguments' text exactly as written, what each syntax's grammar lets a model write read whole,
and a scan that stops where the syntax breaks."""

from __future__ import annotations

import json
from typing import Any

import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st

from calserve.api.tool_scan import CallScanner
from calserve.api.tools import JSON_FRAMING, ToolCalling, parse_tools
from calserve.api.tools_hermes import HERMES_FRAMING
from calserve.api.tools_llama import LLAMA_FRAMING
from calserve.models.demo import demo_tokenizer_json
from calserve.models.tokenizer import Tokenizer

from .test_tool_stream import cut

TOK = Tokenizer(tokenizers.Tokenizer.from_str(demo_tokenizer_json()), eos_token_ids=[2])
TOOLS: Any = [
    {"type": "function", "function": {"name": "now"}},
    {"type": "function", "function": {"name": "note", "parameters": {
        "type": "object", "properties": {"text": {"type": "string", "maxLength": 12},
                                         "tags": {"type": "array", "maxItems": 3,
                                                  "items": {"type": "integer"}},
                                         "flag": {"type": ["boolean", "null"]}}}}},
]
NAMES = frozenset(("now", "note"))
# (framing, how it writes a call's JSON, its separators, its arguments' key)
SYNTAXES = {
    "json": (JSON_FRAMING, (",", ":"), "arguments"),
    "hermes": (HERMES_FRAMING, (", ", ": "), "arguments"),
    "llama3_json": (LLAMA_FRAMING, (", ", ": "), "parameters"),
}

ARGS = st.fixed_dictionaries({}, optional={
    "text": st.text(st.characters(codec="utf-8"), max_size=12),
    "tags": st.lists(st.integers(-999, 999), max_size=3),
    "flag": st.sampled_from([True, False, None])})
CALLS = st.lists(st.tuples(st.sampled_from(["now", "note"]), ARGS), min_size=1, max_size=3)


def in_order(args: dict[str, Any]) -> dict[str, Any]:
    """The arguments in the order of the schema's properties (the order the grammar writes)."""
    order = ["text", "tags", "flag"]
    return dict(sorted(args.items(), key=lambda kv: order.index(kv[0])))


def answer(syntax: str, calls: list[tuple[str, dict[str, Any]]], ascii_: bool = False) -> str:
    """The text a model writes for ``calls`` in ``syntax`` (what the grammar holds it to)."""
    _, seps, key = SYNTAXES[syntax]
    js = [json.dumps({"name": n, key: ({} if n == "now" else in_order(a))}, ensure_ascii=ascii_,
                     separators=seps) for n, a in calls]
    if syntax == "json":
        return '{"tool_calls":[' + ",".join(js) + "]}"
    if syntax == "hermes":
        return "\n".join(f"<tool_call>\n{j}\n</tool_call>" for j in js)
    return js[0]


def scan(syntax: str, pieces: list[str]) -> tuple[CallScanner, list[Any]]:
    s = CallScanner(SYNTAXES[syntax][0], NAMES)
    deltas = [d for p in pieces for d in s.feed(p)]
    return s, deltas


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(sorted(SYNTAXES)), CALLS, st.booleans(),
       st.lists(st.integers(0, 400), max_size=12), st.integers(0, 40))
def test_the_same_calls_whatever_the_pieces(syntax: str, calls: list[tuple[str, dict[str, Any]]],
                                            ascii_: bool, points: list[int], short: int) -> None:
    if syntax == "llama3_json":
        calls = calls[:1]
    text = answer(syntax, calls, ascii_)
    text = text[:len(text) - short]
    whole, _ = scan(syntax, [text])
    pieces, deltas = scan(syntax, cut(text, points))
    got = [(c.name, c.arguments, c.whole) for c in pieces.calls]
    assert got == [(c.name, c.arguments, c.whole) for c in whole.calls]
    assert pieces.start == whole.start and pieces.closed() == whole.closed()
    # the deltas say the same: each call's name first, then its arguments' pieces
    rebuilt: list[list[str]] = []
    for k, name, piece in deltas:
        if name is not None:
            assert k == len(rebuilt)
            rebuilt.append([name, piece])
        else:
            rebuilt[k][1] += piece
    assert [tuple(r) for r in rebuilt] == [(n, a) for n, a, _ in got]
    if not short:  # whole: every call, the arguments exactly as written
        _, seps, _ = SYNTAXES[syntax]
        assert whole.closed() and [(n, a) for n, a, _ in got] == [
            (n, json.dumps({} if n == "now" else in_order(a), ensure_ascii=ascii_,
                           separators=seps))
            for n, a in calls]
    else:  # cut short: a prefix of it
        full, _ = scan(syntax, [answer(syntax, calls, ascii_)])
        for c, f in zip(pieces.calls, full.calls):
            assert c.name == f.name and f.arguments.startswith(c.arguments)


def grammar_takes(tc: ToolCalling, text: str) -> bool:
    m = tc.grammar(TOK, TOK.vocab_size).new_state().matcher
    return bool(m.consume_tokens(TOK.encode(text))) and not m.is_error() and m.is_accepting()


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(sorted(SYNTAXES)), CALLS)
def test_what_the_grammar_lets_a_model_write_is_read_whole(
        syntax: str, calls: list[tuple[str, dict[str, Any]]]) -> None:
    """The framings are the grammars' own: an answer a grammar accepts is closed by the scan
    (and one written otherwise, keys swapped or spaced, is refused by the grammar)."""
    if syntax == "llama3_json":
        calls = calls[:1]
    tc = parse_tools(TOOLS, "required", None, syntax)
    assert tc is not None
    text = answer(syntax, calls)
    assert grammar_takes(tc, text)
    s, _ = scan(syntax, [text])
    assert s.closed() and [c.name for c in s.calls] == [n for n, _ in calls]
    _, seps, key = SYNTAXES[syntax]
    swapped = answer(syntax, calls).replace(
        json.dumps({"name": calls[0][0], key: {}}, separators=seps),
        json.dumps({key: {}, "name": calls[0][0]}, separators=seps), 1)
    if swapped != text:
        assert not grammar_takes(tc, swapped)


def test_where_the_syntax_breaks_the_scan_stops() -> None:
    def calls(syntax: str, text: str) -> list[tuple[str, str, bool]]:
        s, _ = scan(syntax, [text])
        return [(c.name, c.arguments, c.whole) for c in s.calls]

    assert calls("json", '{"response":"hi"}') == []
    assert calls("json", '{"tool_calls":[{"name":"other","arguments":{}}]}') == []  # no such tool
    assert calls("json", '{"tool_calls":[{"name":"now","args":{}}]}') == []
    assert calls("json", '{"tool_calls":[{"name":"now","arguments":{}}x') == [("now", "{}", True)]
    # braces, quotes and escapes inside strings are the arguments' text, not their end
    text = '{"tool_calls":[{"name":"note","arguments":{"text":"}\\"{ ]"}}]}'
    assert calls("json", text) == [("note", '{"text":"}\\"{ ]"}', True)]
    # an escaped name is read as JSON
    assert calls("json", '{"tool_calls":[{"name":"n\\u006fte","arguments":{}}]}') == [
        ("note", "{}", True)]
    # a scalar value (a tool whose parameters are not an object) ends before its delimiter
    assert calls("json", '{"tool_calls":[{"name":"now","arguments":12.5}]}') == [
        ("now", "12.5", True)]
    assert calls("json", '{"tool_calls":[{"name":"now","arguments":"a,}"}]}') == [
        ("now", '"a,}"', True)]
    # Hermes: text first, a tag-like piece that is not the tag, then the calls
    text = "I will <tool> check.\n<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call>"
    s, _ = scan("hermes", [text])
    assert s.start == text.index("<tool_call>") and s.closed()
    assert calls("hermes", "no calls <tool_call") == []
    # Llama: one call and nothing after it is read
    s, _ = scan("llama3_json", ['{"name": "now", "parameters": {}} more'])
    assert s.closed() and s.stopped and [c.arguments for c in s.calls] == ["{}"]
    assert calls("llama3_json", "It is {sunny}.") == []


def test_a_cut_name_waits_and_a_wrong_one_stops() -> None:
    s = CallScanner(JSON_FRAMING, NAMES)
    assert s.feed('{"tool_calls":[{"name":"no') == [] and not s.stopped
    assert s.feed('te","arg') == [] and not s.stopped  # the key must be whole too
    assert s.feed('uments":{"te') == [(0, "note", '{"te')]
    assert s.feed('xt":"a"}}') == [(0, None, 'xt":"a"}')]
    assert s.calls[0].whole and not s.closed()
    assert s.feed("]}") == [] and s.closed() and s.stopped
    bad = CallScanner(JSON_FRAMING, NAMES)
    assert bad.feed('{"tool_calls":[{"name":"nowhere","arguments":{}}]}') == [] and bad.stopped
