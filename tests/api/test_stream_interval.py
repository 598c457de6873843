"""``server.stream_interval_ms`` (off by default): a minimum gap between two token chunks of a
stream, so tokens produced meanwhile go out as one chunk. Off, every token is its own chunk as
soon as it exists; on, the first token is never held, nothing is lost and there is one finish."""

from __future__ import annotations

from typing import Any

import pytest

from .conftest import make_config
from .sse_util import parse_sse, stream_post
from .test_stream_chunks import C, CH, chunk_texts, gen_text


@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
@pytest.mark.parametrize("interval_ms", [0, 50])
async def test_stream_interval_groups_tokens_without_losing_any(
    harness_factory: Any, autojump_clock: Any, interval_ms: int, chat: bool
) -> None:
    n = 40  # the fake engine makes one token per 10 ms
    cfg = make_config(server={"stream_interval_ms": interval_ms})
    async with harness_factory(cfg, token_delay=0.01, coalesce=True) as h:
        if chat:
            path, body = CH, {"messages": [{"role": "user", "content": "q"}]}
            prompt = "<user>q\n<assistant>"
        else:
            path, body, prompt = C, {"prompt": "slow"}, "slow"
        status, raw = await stream_post(h.client, path, {**body, "max_tokens": n, "stream": True})
    assert status == 200
    events = parse_sse(raw)
    assert events[-1] == "[DONE]"
    finishes = [e for e in events[:-1] if e["choices"] and e["choices"][0]["finish_reason"]]
    assert len(finishes) == 1 and finishes[0] is events[-2]
    texts = chunk_texts(events[:-2], chat)  # the token chunks (chat: after the role chunk)
    if chat:
        assert texts[0] == ""  # the role chunk
        texts = texts[1:]
    assert "".join(t or "" for t in texts) + (chunk_texts([events[-2]], chat)[0] or "") \
        == gen_text(prompt, n)
    if interval_ms == 0:
        assert [len(t or "") for t in texts] == [1] * n  # no waiting on purpose
    else:
        assert len(texts[0] or "") == 1  # the first token is never held
        assert max(len(t or "") for t in texts) >= 4  # ~5 tokens per 50 ms chunk
        assert len(texts) <= n // 4
