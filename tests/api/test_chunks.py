"""ChunkEncoder's precomputed bytes equal the OpenAI chunk dicts encoded whole (the reference)."""

from __future__ import annotations

from typing import Any

import msgspec
from hypothesis import given
from hypothesis import strategies as st

from calserve.api.chunks import ChunkEncoder
from calserve.api.render import sse
from calserve.engine.types import Usage

texts = st.text(max_size=40)  # any unicode, incl. quotes, backslashes, control characters
ids = st.from_regex(r"(cmpl|chatcmpl)-[0-9a-f]{24}", fullmatch=True)
models = st.text(min_size=1, max_size=20)
reasons = st.sampled_from([None, "stop", "length"])
chat_lps = st.none() | st.lists(st.fixed_dictionaries(
    {"token": texts, "logprob": st.floats(-50, 0), "bytes": st.lists(st.integers(0, 255)),
     "top_logprobs": st.just([])}), max_size=3)
completion_lps = st.none() | st.fixed_dictionaries(
    {"tokens": st.lists(texts, max_size=3), "token_logprobs": st.lists(st.floats(-50, 0),
                                                                       max_size=3),
     "top_logprobs": st.just([]), "text_offset": st.lists(st.integers(0, 99), max_size=3)})


def reference(chat: bool, rid: str, created: int, model: str, usage: bool, text: str | None,
              lps: Any, fr: str | None, role: bool = False, fp: str | None = None) -> bytes:
    """The chunk as a dict, encoded whole (what the HTTP layer sent before ChunkEncoder)."""
    if chat:
        delta: dict[str, Any] = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        c: dict[str, Any] = {"index": 0, "delta": delta,
                             "logprobs": {"content": lps} if lps is not None else None,
                             "finish_reason": fr}
    else:
        c = {"index": 0, "text": text or "", "logprobs": lps, "finish_reason": fr}
    obj = "chat.completion.chunk" if chat else "text_completion"
    return sse({"id": rid, "object": obj, "created": created, "model": model,
                **({"system_fingerprint": fp} if fp is not None else {}), "choices": [c],
                **({"usage": None} if usage else {})})


@given(chat=st.booleans(), rid=ids, created=st.integers(0, 2**40), model=models,
       usage=st.booleans(), text=st.none() | texts, fr=reasons, role=st.booleans(),
       fp=st.none() | st.from_regex(r"calserve-g[0-9]{1,4}-[0-9a-f]{8}", fullmatch=True),
       data=st.data())
def test_chunks_match_the_reference(chat: bool, rid: str, created: int, model: str, usage: bool,
                                    text: str | None, fr: str | None, role: bool, fp: str | None,
                                    data: st.DataObject) -> None:
    lps = data.draw(chat_lps if chat else completion_lps)
    role = role and chat
    enc = ChunkEncoder(chat=chat, rid=rid, created=created, model=model, include_usage=usage,
                       system_fingerprint=fp)
    assert enc.chunk(text, lps, fr, role=role) == reference(chat, rid, created, model, usage,
                                                            text, lps, fr, role, fp)
    if text is not None:
        assert enc.text(text) == reference(chat, rid, created, model, usage, text, None, None,
                                           fp=fp)
    out = enc.chunk(text, lps, fr, role=role)
    assert out.startswith(b"data: ") and out.endswith(b"\n\n")
    assert msgspec.json.decode(out[6:-2])["id"] == rid


@given(chat=st.booleans(), model=models, p=st.integers(0, 10**6), c=st.integers(0, 10**6))
def test_usage_chunk_matches_the_reference(chat: bool, model: str, p: int, c: int) -> None:
    enc = ChunkEncoder(chat=chat, rid="cmpl-0", created=7, model=model, include_usage=True)
    obj = "chat.completion.chunk" if chat else "text_completion"
    want = sse({"id": "cmpl-0", "object": obj, "created": 7, "model": model, "choices": [],
                "usage": {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}})
    assert enc.usage(Usage(prompt_tokens=p, completion_tokens=c)) == want
