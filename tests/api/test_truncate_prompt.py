"""vLLM's ``truncate_prompt_tokens`` (completions and chat): only the prompt's last k tokens are
served (-1: the model's context, as vLLM). Each answer equals the answer to those k token ids
sent as the prompt; usage counts them; an echo shows them; a text longer than the context is
accepted when truncated; bad values and ``suffix`` are 400s naming the field. Unknown fields are
ignored, so before this was served a client sending it got its whole prompt served (or a 400 for
a prompt it meant to have cut)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from .conftest import make_config
from .real_engine import api_source, real_app
from .sse_util import parse_sse, stream_post

C = "/v1/completions"
CHAT = "/v1/chat/completions"
GREEDY: dict[str, Any] = {"max_tokens": 5, "temperature": 0, "ignore_eos": True}


async def _text(h: Any, path: str, doc: dict[str, Any], stream: bool) -> tuple[str, int | None]:
    """The answer's text and its prompt tokens (streamed: from the usage chunk)."""
    chat = path == CHAT
    if not stream:
        body = await h.post_ok(path, doc)
        ch = body["choices"][0]
        return (ch["message"]["content"] if chat else ch["text"]), body["usage"]["prompt_tokens"]
    status, raw = await stream_post(h.client, path, {**doc, "stream": True,
                                                     "stream_options": {"include_usage": True}})
    assert status == 200, raw
    events = parse_sse(raw)[:-1]
    text = "".join((e["choices"][0]["delta"].get("content") or "") if chat
                   else e["choices"][0]["text"] for e in events if e["choices"])
    return text, events[-1]["usage"]["prompt_tokens"]


@settings(max_examples=15, deadline=None)
@given(k=st.integers(1, 40), words=st.integers(1, 12), chat=st.booleans(), stream=st.booleans())
def test_the_answer_is_the_last_k_tokens_answer(k: int, words: int, chat: bool,
                                                stream: bool) -> None:
    async def main() -> None:
        async with real_app(make_config()) as h:
            text = " ".join(f"w{i}" for i in range(words))
            if chat:
                msgs = [{"role": "user", "content": text}]
                ids = (await h.post_ok("/tokenize", {"messages": msgs}))["tokens"]
                doc: dict[str, Any] = {"messages": msgs, **GREEDY}
            else:
                ids = (await h.post_ok("/tokenize", {"prompt": text}))["tokens"]
                doc = {"prompt": text, **GREEDY}
            got, n = await _text(h, CHAT if chat else C, {**doc, "truncate_prompt_tokens": k},
                                 stream)
            kept = ids[-k:]
            want, m = await _text(h, C, {"prompt": kept, **GREEDY}, False)
            assert (got, n) == (want, m) and m == len(kept)

    import trio

    trio.run(main)


async def test_echo_prompt_lists_token_prompts_and_the_context() -> None:
    async with real_app(make_config(), sources=[api_source(max_seq=64)]) as h:
        body = await h.post_ok(C, {"prompt": "abcdefghij", "echo": True, "max_tokens": 2,
                                   "temperature": 0, "truncate_prompt_tokens": 4})
        assert body["choices"][0]["text"].startswith("ghij")
        assert not body["choices"][0]["text"].startswith("fghij")
        assert body["usage"]["prompt_tokens"] == 4
        # a list of prompts: each its own last k tokens
        for prompts in (["abcdef", "xy"], [[1, 2, 3, 4, 5], [6, 7]]):
            body = await h.post_ok(C, {"prompt": prompts, "max_tokens": 1,
                                       "truncate_prompt_tokens": 3, "temperature": 0})
            assert body["usage"]["prompt_tokens"] == 3 + 2
        # a text past what the context could ever hold is served when truncated ...
        long = "ab" * 500
        status, err, _ = await h.post(C, {"prompt": long, "max_tokens": 1})
        assert status == 400 and err["error"]["code"] == "context_length_exceeded", err
        body = await h.post_ok(C, {"prompt": long, "max_tokens": 1, "truncate_prompt_tokens": 10})
        assert body["usage"]["prompt_tokens"] == 10
        body = await h.post_ok(C, {"prompt": list(range(80)), "max_tokens": 1,
                                   "truncate_prompt_tokens": 60})
        assert body["usage"]["prompt_tokens"] == 60
        # ... and -1 keeps the context's worth, which leaves no room to answer: vLLM's 400
        status, err, _ = await h.post(C, {"prompt": long, "max_tokens": 1,
                                          "truncate_prompt_tokens": -1})
        assert status == 400 and err["error"]["code"] == "context_length_exceeded", err
        body = await h.post_ok(C, {"prompt": "short", "max_tokens": 1, "truncate_prompt_tokens": -1})
        assert body["usage"]["prompt_tokens"] == 5


@pytest.mark.parametrize("value", [0, -2, 65, 2**31 + 1, 2**63, "x", 1.5])
@pytest.mark.parametrize("chat", [False, True])
async def test_bad_values_name_the_field(value: Any, chat: bool) -> None:
    async with real_app(make_config(), sources=[api_source(max_seq=64)]) as h:
        doc: dict[str, Any] = ({"messages": [{"role": "user", "content": "hi"}]} if chat
                               else {"prompt": "hi"})
        status, err, _ = await h.post(CHAT if chat else C, {**doc, "max_tokens": 1,
                                                            "truncate_prompt_tokens": value})
        assert status == 400 and err["error"]["param"] == "truncate_prompt_tokens", err
