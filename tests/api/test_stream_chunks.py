"""SSE chunks carry something: a token that adds no text yet (text held back for stop-string
matching, or a partial UTF-8 character) produces no ``"text": ""`` / ``"content": ""`` chunk
mid-stream, unless it carries logprobs (then it must be sent, so every token has its logprob).
The first chat chunk (role) and the final chunk (finish_reason) are the only text-less chunks."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from .conftest import Harness, make_config
from .fake_engine import expected_token
from .real_engine import ChatCharTokenizer, api_source, real_app
from .sse_util import parse_sse, stream_post

C = "/v1/completions"
CH = "/v1/chat/completions"


def gen_text(prompt: str, n: int) -> str:
    ids = list(prompt.encode())
    return "".join(chr(expected_token(ids, None, i)) for i in range(n))


def held_stop(prompt: str, n: int) -> str:
    """A stop string that never matches but whose first character occurs in the output, so the
    fake engine holds text back (TokenEvents with text "")."""
    text = gen_text(prompt, n)
    return text[2] + "#"


def chunk_texts(events: list[Any], chat: bool) -> list[str | None]:
    out: list[str | None] = []
    for e in events:
        if e == "[DONE]" or not e.get("choices"):
            continue
        c = e["choices"][0]
        out.append(c["delta"].get("content") if chat else c["text"])
    return out


@pytest.mark.parametrize("coalesce", [False, True], ids=["plain", "receive_many"])
async def test_held_text_sends_no_empty_chunks(harness_factory: Any, coalesce: bool) -> None:
    async with harness_factory(token_delay=0.001, coalesce=coalesce) as h:
        n = 12
        stop = held_stop("held", n)
        full = gen_text("held", n)
        assert full.count(stop[0]) >= 1
        status, raw = await stream_post(h.client, C, {"prompt": "held", "max_tokens": n, "stop": [stop],
                                          "stream": True})
        assert status == 200
        events = parse_sse(raw)
        assert events[-1] == "[DONE]"
        texts = chunk_texts(events, chat=False)
        assert "".join(t or "" for t in texts) == full
        assert all(texts[:-1]), texts  # only the final (finish_reason) chunk may be empty
        assert events[-2]["choices"][0]["finish_reason"] == "length"


async def test_held_text_chat_only_role_and_final_chunks_lack_content(h: Harness) -> None:
    n = 10
    prompt = "<user>hey\n<assistant>"
    stop = held_stop(prompt, n)
    status, raw = await stream_post(h.client, CH, {"messages": [{"role": "user", "content": "hey"}],
                                       "max_tokens": n, "stop": stop, "stream": True})
    events = parse_sse(raw)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["choices"][0]["delta"] == {}
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    middle = [c["choices"][0]["delta"] for c in chunks[1:-1]]
    assert all(d.get("content") for d in middle), middle
    assert "".join(d["content"] for d in middle) == gen_text(prompt, n)


async def test_held_text_with_logprobs_still_sends_every_token(h: Harness) -> None:
    n = 12
    stop = held_stop("lp", n)
    status, raw = await stream_post(h.client, C, {"prompt": "lp", "max_tokens": n, "stop": [stop],
                                      "logprobs": 1, "stream": True})
    chunks = [e for e in parse_sse(raw)[:-1]]
    lps = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0]["logprobs"]]
    assert sum(len(lp["tokens"]) for lp in lps) == n  # one logprob per token, none lost
    assert "".join(t for lp in lps for t in lp["tokens"]) == gen_text("lp", n)
    # the held tokens' chunks are sent (with logprobs) although their text is empty
    assert any(c["choices"][0]["text"] == "" and c["choices"][0]["logprobs"]
               for c in chunks[:-1])
    assert all(c["choices"][0]["text"] or c["choices"][0]["logprobs"] for c in chunks[:-1])
    # chat: same rule for content + logprobs.content
    msgs = [{"role": "user", "content": "lp"}]
    prompt = "<user>lp\n<assistant>"
    status, raw = await stream_post(h.client, CH, {"messages": msgs, "max_tokens": n, "logprobs": True,
                                       "stop": [held_stop(prompt, n)], "stream": True})
    chunks = parse_sse(raw)[:-1]
    content = [x for c in chunks if c["choices"][0]["logprobs"]
               for x in c["choices"][0]["logprobs"]["content"]]
    assert len(content) == n
    for c in chunks[1:-1]:
        ch = c["choices"][0]
        assert ch["delta"].get("content") or ch["logprobs"], ch


class Utf8PairTokenizer(ChatCharTokenizer):
    """Ids 0..63 are ASCII; ids 64..127 are single UTF-8 bytes of two-byte characters (even: the
    lead byte 0xC3, odd: a continuation byte), so a generated lead byte is a partial character
    that the engine's incremental detokenizer holds back (a TokenEvent with text "")."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        raw = bytearray()
        for i in ids:
            if i < 64:
                raw.append(65 + i % 58)
            else:
                raw.append(0xC3 if i % 2 == 0 else 0x80 + i % 64)
        return raw.decode("utf-8", errors="replace")

    def encode(self, text: str) -> list[int]:
        return [ord(c) % 64 for c in text]


@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
async def test_partial_utf8_sends_no_empty_chunks_real_engine(autojump_clock: Any,
                                                              chat: bool) -> None:
    """Real engine (FakeBackend): greedy output with partial characters, streamed vs not."""
    src = api_source(tokenizer=Utf8PairTokenizer())
    async with real_app(make_config(), sources=[src]) as h:
        base: dict[str, Any] = ({"messages": [{"role": "user", "content": "utf"}]} if chat
                                else {"prompt": "utf8"})
        path = CH if chat else C
        body = {**base, "max_tokens": 60, "temperature": 0, "ignore_eos": True}
        status, whole, _ = await h.post(path, body)
        assert status == 200
        text = whole["choices"][0]["message"]["content"] if chat else whole["choices"][0]["text"]
        assert any(ord(c) >= 0x80 for c in text)  # multi-byte characters did occur
        status, raw = await stream_post(h.client, path, {**body, "stream": True})
        events = parse_sse(raw)
        assert events[-1] == "[DONE]"
        texts = chunk_texts(events, chat)
        assert "".join(t or "" for t in texts) == text
        mid = texts[1:-1] if chat else texts[:-1]
        assert all(mid), texts
        # with logprobs every token is accounted for, held ones included
        status, raw = await stream_post(h.client, path, {**body, "stream": True, "logprobs": True if chat
                                             else 0})
        chunks = [e for e in parse_sse(raw)[:-1] if e["choices"]]
        per_chunk = [c["choices"][0]["logprobs"] for c in chunks]
        n = sum(len(lp["content"] if chat else lp["tokens"]) for lp in per_chunk if lp)
        assert n == 60


@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
async def test_a_batch_of_queued_tokens_is_one_chunk(harness_factory: Any, chat: bool) -> None:
    """receive_many hands over several token events at once: they become one chunk whose text
    and logprobs are the concatenation (offsets continue), not one chunk per token."""
    async with harness_factory(token_delay=0.0, coalesce=True) as h:
        n = 9
        if chat:
            path, body = CH, {"messages": [{"role": "user", "content": "q"}], "logprobs": True,
                              "top_logprobs": 1}
            prompt = "<user>q\n<assistant>"
        else:
            path, body, prompt = C, {"prompt": "slow", "logprobs": 1}, "slow"
        status, raw = await stream_post(h.client, path, {**body, "max_tokens": n,
                                                         "stream": True})
        assert status == 200
        events = parse_sse(raw)
        token_chunks = [e for e in events[:-1]
                        if e["choices"] and e["choices"][0]["logprobs"] is not None]
        batches_with_tokens = [b for b in h.engine.batches if b > 0]
        assert max(h.engine.batches) > 1  # the condition: several events in one answer
        assert len(token_chunks) <= len(batches_with_tokens) < n
        texts = chunk_texts(events, chat)
        assert "".join(t or "" for t in texts) == gen_text(prompt, n)
        if chat:
            items = [x for c in token_chunks for x in c["choices"][0]["logprobs"]["content"]]
            assert "".join(x["token"] for x in items) == gen_text(prompt, n)
        else:
            lps = [c["choices"][0]["logprobs"] for c in token_chunks]
            offsets = [o for lp in lps for o in lp["text_offset"]]
            assert offsets == list(range(n))
            assert all(len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"])
                       for lp in lps)
            for c, lp in zip(token_chunks, lps):
                assert c["choices"][0]["text"] == "".join(lp["tokens"])
