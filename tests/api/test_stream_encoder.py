"""StreamEncoder (calserve.api.stream_encoder) alone: engine events in, the SSE bytes a client gets
out. No trio, no HTTP: every rule of a stream's shape, checked on hand-built events against the
OpenAI chunk dicts encoded whole (``test_chunks.reference``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from calserve import errors as E
from calserve.api.chunks import ChunkEncoder
from calserve.api.convert import Prepared
from calserve.api.render import DONE, LogprobFormatter, sse
from calserve.api.stream_encoder import StreamEncoder
from calserve.engine.types import (
    ErrorEvent, Event, FinishEvent, FinishReason, GenerateRequest, TokenEvent, TokenLogprob,
    Usage,
)

from .fake_engine import FakeTokenizer
from .test_chunks import reference

RID, CREATED, MODEL = "cmpl-0", 7, "qwen3"


def make(chat: bool = False, *, usage: bool = False, echo: str = "",
         logprobs: bool = False) -> StreamEncoder:
    chunks = ChunkEncoder(chat=chat, rid=RID, created=CREATED, model=MODEL, include_usage=usage)
    return StreamEncoder(chunks, include_usage=usage, echo_text=echo,
                         logprobs=LogprobFormatter(FakeTokenizer()) if logprobs else None)


def ref(chat: bool, text: str | None, lps: Any = None, fr: str | None = None, *,
        usage: bool = False, role: bool = False) -> bytes:
    return reference(chat, RID, CREATED, MODEL, usage, text, lps, fr, role)


def usage_ref(chat: bool, p: int, c: int) -> bytes:
    obj = "chat.completion.chunk" if chat else "text_completion"
    return sse({"id": RID, "object": obj, "created": CREATED, "model": MODEL, "choices": [],
                "usage": {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}})


def tok(text: str, *ids: int, lps: Sequence[TokenLogprob] | None = None) -> TokenEvent:
    return TokenEvent(ids or (ord("a"),), text, tuple(lps) if lps is not None else None)


def finish(text: str = "", reason: FinishReason = FinishReason.LENGTH, p: int = 3,
           c: int = 2) -> FinishEvent:
    return FinishEvent(reason, Usage(p, c), text)


def payloads(raw: bytes) -> list[Any]:
    out: list[Any] = []
    for block in raw.split(b"\n\n")[:-1]:
        assert block.startswith(b"data: ")
        body = block[6:]
        out.append("[DONE]" if body == b"[DONE]" else msgspec.json.decode(body))
    return out


@given(chat=st.booleans(), text=st.text(max_size=30))
def test_one_token_event_is_one_text_chunk(chat: bool, text: str) -> None:
    enc = make(chat)
    out = enc.encode([tok(text, 1, 2)])
    assert out == (ref(chat, text) if text else b"")  # no text yet (held back): nothing
    assert enc.tokens == 2 and not enc.finished and enc.terminal is None


@pytest.mark.parametrize("chat", [False, True])
def test_a_batch_is_one_chunk_and_a_textless_batch_sends_nothing(chat: bool) -> None:
    enc = make(chat)
    assert enc.encode([tok("ab", 1, 2), tok(""), tok("c")]) == ref(chat, "abc")
    assert enc.tokens == 4
    assert enc.encode([tok(""), tok("")]) == b""
    assert enc.tokens == 2 and not enc.finished


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("usage", [False, True])
def test_finish_sends_tokens_then_finish_reason_then_usage_then_done(chat: bool,
                                                                    usage: bool) -> None:
    enc = make(chat, usage=usage)
    out = enc.encode([tok("x"), finish("yz", FinishReason.STOP, p=4, c=3)])
    want = (ref(chat, "x", usage=usage) + ref(chat, "yz", None, "stop", usage=usage)
            + (usage_ref(chat, 4, 3) if usage else b"") + DONE)
    assert out == want
    assert enc.finished and enc.tokens == 1 and isinstance(enc.terminal, FinishEvent)


def test_finish_without_text_chat_has_no_content_key_completion_has_empty_text() -> None:
    chat = make(True)
    assert chat.encode([finish()]) == ref(True, None, None, "length") + DONE
    assert payloads(ref(True, None, None, "length"))[0]["choices"][0]["delta"] == {}
    comp = make(False)
    assert comp.encode([finish()]) == ref(False, "", None, "length") + DONE
    for reason, fr in ((FinishReason.DEADLINE, "length"), (FinishReason.STOP, "stop")):
        assert make().encode([finish(reason=reason)]) == ref(False, "", None, fr) + DONE


@pytest.mark.parametrize("kind,status_type,code", [
    ("device_error", "server_error", "device_error"),
    ("unavailable", "service_unavailable", "model_unavailable"),
    ("shutdown", "service_unavailable", "model_unavailable"),
    ("internal", "server_error", "internal_error"),
])
def test_error_after_the_stream_started_is_an_error_event_without_done(
        kind: str, status_type: str, code: str) -> None:
    enc = make(usage=True)
    out = enc.encode([tok("a"), ErrorEvent("it broke", kind)])
    *chunks, last = payloads(out)
    assert DONE not in out and "[DONE]" not in chunks
    assert [c["choices"][0]["text"] for c in chunks] == ["a"]
    assert last == {"error": {"message": "it broke", "type": status_type, "param": None,
                              "code": code}}
    assert enc.finished and isinstance(enc.terminal, ErrorEvent)


def test_events_ending_without_a_terminal_are_an_error_event() -> None:
    enc = make()
    out = enc.encode([])
    assert payloads(out) == [{"error": {
        "message": "the engine ended the request without a terminal event",
        "type": "server_error", "param": None, "code": "internal_error"}}]
    assert enc.finished and enc.terminal is None and enc.tokens == 0


def test_a_failed_event_stream_is_an_error_event_without_internals() -> None:
    enc = make()
    (err,) = payloads(enc.failure(RuntimeError("secret internals")))
    assert err["error"]["type"] == "server_error" and err["error"]["code"] == "internal_error"
    assert "secret" not in err["error"]["message"]
    (err,) = payloads(enc.failure(E.DeviceError("the device faulted")))
    assert err["error"]["code"] == "device_error"
    assert not enc.finished  # the pump decides; nothing was encoded as the end


def test_opening_is_the_role_chunk_for_chat_and_the_echo_for_completions() -> None:
    assert make(True).opening() == ref(True, "", role=True)
    assert make(True, usage=True).opening() == ref(True, "", role=True, usage=True)
    assert make(False, echo="say hi").opening() == ref(False, "say hi")
    assert make(False).opening() == b""


def test_events_after_the_terminal_in_one_batch_are_ignored() -> None:
    enc = make()
    assert enc.encode([finish(), tok("late")]) == ref(False, "", None, "length") + DONE
    assert enc.tokens == 0


def test_completion_logprobs_of_a_batch_are_merged_into_one_chunk() -> None:
    enc = make(logprobs=True)
    lp = [TokenLogprob(ord("a"), -0.5, ((ord("a"), -0.5), (ord("b"), -1.5)))]
    lp2 = [TokenLogprob(ord("c"), -0.25, ())]
    out = enc.encode([tok("a", ord("a"), lps=lp), tok("c", ord("c"), lps=lp2)])
    assert out == ref(False, "ac", {"tokens": ["a", "c"], "token_logprobs": [-0.5, -0.25],
                                    "top_logprobs": [{"a": -0.5, "b": -1.5}, {}],
                                    "text_offset": [0, 1]})
    # text_offset runs on across chunks; a lone token with logprobs still carries them
    out = enc.encode([tok("", ord("d"), lps=[TokenLogprob(ord("d"), -1.0, ())])])
    assert out == ref(False, "", {"tokens": ["d"], "token_logprobs": [-1.0],
                                  "top_logprobs": [{}], "text_offset": [2]})
    # logprobs asked for but none in the events: plain text chunks, and "" sends nothing
    assert enc.encode([tok("e")]) == ref(False, "e")
    assert enc.encode([tok("")]) == b""


def test_chat_logprobs_of_a_batch_are_one_content_list() -> None:
    enc = make(True, logprobs=True)
    out = enc.encode([tok("h", ord("h"), lps=[TokenLogprob(ord("h"), -0.1, ((ord("i"), -2.0),))]),
                      tok("i", ord("i"), lps=[TokenLogprob(ord("i"), -0.2, ())])])
    assert out == ref(True, "hi", [
        {"token": "h", "logprob": -0.1, "bytes": [104],
         "top_logprobs": [{"token": "i", "logprob": -2.0, "bytes": [105]}]},
        {"token": "i", "logprob": -0.2, "bytes": [105], "top_logprobs": []}])


def test_without_logprobs_requested_the_events_logprobs_are_not_sent() -> None:
    enc = make()
    assert enc.encode([tok("a", lps=[TokenLogprob(97, -0.5, ())])]) == ref(False, "a")


@given(chat=st.booleans(), usage=st.booleans(), data=st.data())
def test_any_grouping_of_the_events_sends_the_same_text(chat: bool, usage: bool,
                                                        data: st.DataObject) -> None:
    """Grouping changes how many chunks, never what they add up to: the texts in order, one
    finish chunk, the usage chunk, ``[DONE]`` last."""
    texts = data.draw(st.lists(st.text(max_size=4), max_size=12))
    events: list[Event] = [tok(t) for t in texts] + [finish("!", c=len(texts))]
    cuts = sorted(data.draw(st.sets(st.integers(1, len(events) - 1), max_size=len(events)))
                  if len(events) > 1 else set())
    enc = make(chat, usage=usage)
    raw = enc.opening()
    for a, b in zip([0, *cuts], [*cuts, len(events)]):
        assert not enc.finished
        raw += enc.encode(events[a:b])
    assert enc.finished
    got = payloads(raw)
    assert got[-1] == "[DONE]"
    chunks = [c for c in got[:-1] if c["choices"]]
    key = (lambda c: c["choices"][0]["delta"].get("content") or "") if chat else (
        lambda c: c["choices"][0]["text"])
    assert "".join(key(c) for c in chunks) == "".join(texts) + "!"
    assert [c["choices"][0]["finish_reason"] for c in chunks].count("length") == 1
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert ([c for c in got[:-1] if not c["choices"]] != []) == usage


def test_for_request_takes_the_requests_shape() -> None:
    fmt = LogprobFormatter(FakeTokenizer())
    for kind, obj, prefix in (("chat", "chat.completion.chunk", "chatcmpl-"),
                              ("completion", "text_completion", "cmpl-")):
        prep = Prepared(kind, "m1", GenerateRequest((1,)), True, True,
                        "", None)
        enc = StreamEncoder.for_request(prep, fmt)
        (c,) = payloads(enc.encode([tok("z")]))
        assert c["object"] == obj and c["model"] == "m1" and c["id"].startswith(prefix)
        assert c["usage"] is None  # include_usage
    prep = Prepared("completion", "m1", GenerateRequest((1,)), True, False, "echo", 1)
    enc = StreamEncoder.for_request(prep, fmt)
    assert payloads(enc.opening())[0]["choices"][0]["text"] == "echo"
    (c,) = payloads(enc.encode([tok("q", ord("q"), lps=[TokenLogprob(ord("q"), -1.0, ())])]))
    assert c["choices"][0]["logprobs"]["tokens"] == ["q"]
