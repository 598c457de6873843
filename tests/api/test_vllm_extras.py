"""vLLM's sampling extensions ``allowed_token_ids`` (only these tokens may be drawn),
``include_stop_str_in_output`` (the matched stop string stays in the text) and
``skip_special_tokens`` (false: special tokens' text kept), completions and chat, streamed or not. Unknown fields are ignored, so before these were served a client sending them got
tokens outside its set, or text without its stop string, silently."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import tokenizers
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from calserve.engine.logits import SeqSamplingState
from calserve.engine.types import SamplingParams
from calserve.models.demo_model import demo_tokenizer_json
from calserve.models.tokenizer import Tokenizer

from .conftest import make_config
from .real_engine import ChatCharTokenizer, api_source, real_app
from .sse_util import parse_sse, stream_post

C = "/v1/completions"
CHAT = "/v1/chat/completions"
TOK = ChatCharTokenizer()


def ids_of(text: str) -> list[int]:
    """The char tokenizer's ids of generated text (ids < 90 are one printable char each)."""
    return TOK.encode(text)


@settings(max_examples=20, deadline=None)
@given(allowed=st.sets(st.integers(0, 89), min_size=1, max_size=6), seed=st.integers(0, 2**31),
       chat=st.booleans(), stream=st.booleans())
def test_only_allowed_tokens_are_drawn(allowed: set[int], seed: int, chat: bool,
                                       stream: bool) -> None:
    async def main() -> None:
        async with real_app(make_config()) as h:
            base: dict[str, Any] = ({"messages": [{"role": "user", "content": "hi"}]} if chat
                                    else {"prompt": "hello"})
            # a large bias on a banned token does not get it drawn either
            banned = next(t for t in range(90) if t not in allowed)
            doc = {**base, "max_tokens": 12, "temperature": 1.5, "seed": seed, "ignore_eos": True,
                   "allowed_token_ids": sorted(allowed), "logit_bias": {str(banned): 100}}
            if stream:
                status, raw = await stream_post(h.client, CHAT if chat else C,
                                                {**doc, "stream": True})
                assert status == 200
                events = parse_sse(raw)[:-1]
                text = "".join((e["choices"][0]["delta"].get("content") or "") if chat
                               else e["choices"][0]["text"] for e in events if e["choices"])
            else:
                body = await h.post_ok(CHAT if chat else C, doc)
                ch = body["choices"][0]
                text = ch["message"]["content"] if chat else ch["text"]
                assert body["usage"]["completion_tokens"] == 12
            assert len(text) == 12 and set(ids_of(text)) <= allowed, (text, allowed)

    trio.run(main)


async def test_one_allowed_token_and_greedy() -> None:
    async with real_app(make_config()) as h:
        body = await h.post_ok(C, {"prompt": "hello", "max_tokens": 5, "temperature": 0,
                                   "ignore_eos": True, "allowed_token_ids": [7]})
        assert ids_of(body["choices"][0]["text"]) == [7] * 5
        # the set does not change what is reported: logprobs are the raw logits' (as vLLM)
        plain = await h.post_ok(C, {"prompt": "hello", "max_tokens": 1, "temperature": 0,
                                    "logprobs": 1})
        first = plain["choices"][0]["logprobs"]["tokens"][0]
        body = await h.post_ok(C, {"prompt": "hello", "max_tokens": 1, "temperature": 0,
                                   "logprobs": 1, "allowed_token_ids": [TOK.encode(first)[0]]})
        assert body["choices"][0]["logprobs"] == plain["choices"][0]["logprobs"]


def test_allowed_ids_and_a_grammar_mask_combine() -> None:
    """With constrained decoding too, a token must pass both masks (bitwise and of the rows)."""
    vocab = 70
    st_ = SeqSamplingState(np.array([1, 2], np.int32),
                           SamplingParams(allowed_token_ids=(3, 5, 40, 69)), vocab)
    grammar_row = np.zeros(3, np.int32)
    for t in (5, 6, 40):  # the grammar's own choice this step
        grammar_row[t // 32] |= np.int32(1 << (t % 32))
    both = st_.lane([], grammar_row).allowed
    alone = st_.lane([], None).allowed
    assert both is not None and alone is not None

    def members(row: np.ndarray) -> list[int]:
        bits = np.unpackbits(row.view(np.uint8), bitorder="little")[:vocab]
        return [int(t) for t in np.flatnonzero(bits)]

    assert members(alone) == [3, 5, 40, 69]
    assert members(both) == [5, 40]


@pytest.mark.parametrize("path", [C, CHAT])
async def test_include_stop_str_in_output(path: str) -> None:
    async with real_app(make_config()) as h:
        base: dict[str, Any] = ({"prompt": "hello"} if path == C
                                else {"messages": [{"role": "user", "content": "hello"}]})
        base |= {"max_tokens": 12, "temperature": 0, "ignore_eos": True}

        async def text_of(doc: dict[str, Any]) -> tuple[str, str]:
            body = await h.post_ok(path, doc)
            ch = body["choices"][0]
            return (ch["text"] if path == C else ch["message"]["content"]), ch["finish_reason"]

        full, _ = await text_of(base)
        stop = full[4:6]
        cut = full.index(stop)
        assert await text_of({**base, "stop": [stop]}) == (full[:cut], "stop")
        assert await text_of({**base, "stop": [stop], "include_stop_str_in_output": True}) == (
            full[:cut + len(stop)], "stop")
        status, raw = await stream_post(h.client, path, {**base, "stop": [stop], "stream": True,
                                                         "include_stop_str_in_output": True})
        assert status == 200
        events = parse_sse(raw)[:-1]
        text = "".join((e["choices"][0]["text"] if path == C
                        else e["choices"][0]["delta"].get("content") or "")
                       for e in events if e["choices"])
        assert text == full[:cut + len(stop)]


async def test_bad_allowed_token_ids_name_the_field() -> None:
    async with real_app(make_config()) as h:
        for bad, param in (([], "allowed_token_ids"), ([TOK.vocab_size], "allowed_token_ids[0]"),
                           ([1, -1], "allowed_token_ids"), ("x", "allowed_token_ids"),
                           ([1.5], "allowed_token_ids")):
            status, err, _ = await h.post(C, {"prompt": "a", "allowed_token_ids": bad})
            assert status == 400 and err["error"]["param"].startswith(param), (bad, err)


async def test_skip_special_tokens_false_keeps_their_text() -> None:
    """The demo tokenizer's ChatML specials (id 1 is ``<|im_start|>``): skipped in the text by
    default, written out with ``skip_special_tokens: false``, streamed and not."""
    tok = Tokenizer(tokenizers.Tokenizer.from_str(demo_tokenizer_json()))
    assert tok.id_to_token(1) == "<|im_start|>" and 1 in tok.special_token_ids
    src = api_source(tokenizer=tok, vocab_size=tok.vocab_size)
    async with real_app(make_config(), sources=[src]) as h:
        doc = {"prompt": "hello", "max_tokens": 3, "temperature": 0, "logit_bias": {"1": 100}}
        body = await h.post_ok(C, doc)
        assert body["choices"][0]["text"] == "" and body["usage"]["completion_tokens"] == 3
        body = await h.post_ok(C, {**doc, "skip_special_tokens": False})
        assert body["choices"][0]["text"] == "<|im_start|>" * 3
        status, raw = await stream_post(h.client, C, {**doc, "skip_special_tokens": False,
                                                      "stream": True})
        assert status == 200
        assert "".join(e["choices"][0]["text"] for e in parse_sse(raw)[:-1]
                       if e["choices"]) == "<|im_start|>" * 3
