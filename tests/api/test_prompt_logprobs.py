"""vLLM's ``prompt_logprobs`` extension (completions and chat): each prompt token's logprob, its
rank and the k most likely tokens at its position, in vLLM's shape — a list per prompt token (the
first null), each ``{"<token id>": {"logprob", "rank", "decoded_token"}}`` — per completion
choice, once per chat response. The engine scores the prompt as for ``echo`` + ``logprobs``
(tests/api/test_echo_logprobs.py); here the numbers are checked against the fake model computed
from scratch, ranks included."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from calserve.testing.fake_device import fake_logits, history_hash

from .conftest import make_config
from .real_engine import ChatCharTokenizer, real_app
from .test_echo_logprobs import scoring  # noqa: F401 (autouse: each test both ways of scoring)

C = "/v1/completions"
CHAT = "/v1/chat/completions"
TOK = ChatCharTokenizer()
V = TOK.vocab_size


def expected(ids: list[int], k: int) -> list[dict[str, tuple[float, int]] | None]:
    """vLLM's entries for ``ids`` under the fake model, from scratch: token id -> (logprob,
    rank) of the prompt token (rank: 1 + the tokens with a higher logit) and the k best."""
    out: list[dict[str, tuple[float, int]] | None] = [None]
    for i in range(1, len(ids)):
        x = fake_logits(history_hash(ids[:i]), V).astype(np.float64)
        lse = float(x.max() + np.log(np.exp(x - x.max()).sum()))
        t = ids[i]
        entry = {str(t): (float(x[t] - lse), 1 + int((x > x[t]).sum()))}
        order = sorted(range(V), key=lambda j: (-x[j], j))[:k]
        for r, j in enumerate(order, start=1):
            entry[str(j)] = (float(x[j] - lse), r)
        out.append(entry)
    return out


def check(got: list[Any], ids: list[int], k: int) -> None:
    want = expected(ids, k)
    assert len(got) == len(ids)
    for g, w in zip(got, want, strict=True):
        if w is None:
            assert g is None
            continue
        assert list(g) == list(w)  # the prompt token first, then the k best
        for key, (lp, rank) in w.items():
            assert g[key]["logprob"] == pytest.approx(lp, abs=1e-5)
            assert g[key]["rank"] == rank
            assert g[key]["decoded_token"] == TOK.decode([int(key)])



async def test_completion_prompt_logprobs_beside_an_unchanged_completion() -> None:
    async with real_app(make_config()) as h:
        prompt = "the quick brown fox"
        ids = TOK.encode(prompt)
        base = {"prompt": prompt, "max_tokens": 5, "temperature": 0, "ignore_eos": True}
        plain = (await h.post_ok(C, base))["choices"][0]
        for k in (0, 1, 3):
            body = await h.post_ok(C, {**base, "prompt_logprobs": k})
            ch = body["choices"][0]
            check(ch["prompt_logprobs"], ids, k)
            assert ch["text"] == plain["text"] and ch["logprobs"] is None
            assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 5,
                                     "total_tokens": len(ids) + 5}
        # with the completion's own logprobs: those are the completion's tokens only
        with_lps = (await h.post_ok(C, {**base, "logprobs": 2}))["choices"][0]["logprobs"]
        ch = (await h.post_ok(C, {**base, "logprobs": 2, "prompt_logprobs": 4}))["choices"][0]
        assert ch["logprobs"] == with_lps
        check(ch["prompt_logprobs"], ids, 4)
        # nothing asked: no such field
        assert "prompt_logprobs" not in plain


async def test_with_echo_each_answer_has_its_own_top_k() -> None:
    """``echo`` + ``logprobs`` 1 and ``prompt_logprobs`` 3 in one request: one scoring pass, the
    echoed entries cut to 1 alternative, vLLM's list to 3."""
    async with real_app(make_config()) as h:
        ids = TOK.encode("scored twice")
        doc = {"prompt": ids, "max_tokens": 2, "temperature": 0, "ignore_eos": True,
               "echo": True, "logprobs": 1}
        echo_only = (await h.post_ok(C, doc))["choices"][0]
        both = (await h.post_ok(C, {**doc, "prompt_logprobs": 3}))["choices"][0]
        assert both["logprobs"] == echo_only["logprobs"]
        assert both["text"] == echo_only["text"]
        check(both["prompt_logprobs"], ids, 3)
        # and the other way round: echo's top 4, vLLM's 0
        wide = (await h.post_ok(C, {**doc, "logprobs": 4}))["choices"][0]
        both = (await h.post_ok(C, {**doc, "logprobs": 4, "prompt_logprobs": 0}))["choices"][0]
        assert both["logprobs"] == wide["logprobs"]
        check(both["prompt_logprobs"], ids, 0)


async def test_scoring_only_and_lists_of_prompts_with_n() -> None:
    async with real_app(make_config(server={"max_n": 4, "max_prompts": 4})) as h:
        prompts = [TOK.encode(s) for s in ("first prompt", "2nd", "third one here")]
        body = await h.post_ok(C, {"prompt": prompts, "max_tokens": 0, "prompt_logprobs": 2})
        assert [c["text"] for c in body["choices"]] == ["", "", ""]
        for c, ids in zip(body["choices"], prompts, strict=True):
            check(c["prompt_logprobs"], ids, 2)
            assert c["finish_reason"] == "length"
        assert body["usage"]["completion_tokens"] == 0
        body = await h.post_ok(C, {"prompt": prompts, "max_tokens": 2, "n": 2, "seed": 3,
                                    "temperature": 1.0, "prompt_logprobs": 1})
        assert len(body["choices"]) == 6
        for i, c in enumerate(body["choices"]):
            check(c["prompt_logprobs"], prompts[i // 2], 1)


async def test_chat_prompt_logprobs_once_per_response() -> None:
    async with real_app(make_config(server={"max_n": 4})) as h:
        msgs = [{"role": "user", "content": "score my prompt"}]
        base = {"messages": msgs, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        plain = await h.post_ok(CHAT, base)
        ids = (await h.post_ok("/tokenize", {"messages": msgs}))["tokens"]
        assert len(ids) == plain["usage"]["prompt_tokens"]
        body = await h.post_ok(CHAT, {**base, "prompt_logprobs": 2, "logprobs": True,
                                       "top_logprobs": 1})
        check(body["prompt_logprobs"], ids, 2)
        ch = body["choices"][0]
        assert "prompt_logprobs" not in ch
        assert ch["message"]["content"] == plain["choices"][0]["message"]["content"]
        assert len(ch["logprobs"]["content"]) == 4  # the answer's tokens, not the prompt's
        body = await h.post_ok(CHAT, {**base, "n": 3, "prompt_logprobs": 0})
        check(body["prompt_logprobs"], ids, 0)
        assert all("prompt_logprobs" not in c for c in body["choices"])
        assert "prompt_logprobs" not in plain


@pytest.mark.parametrize("path", [C, CHAT])
async def test_bad_prompt_logprobs_name_the_field(path: str) -> None:
    async with real_app(make_config()) as h:
        base: dict[str, Any] = ({"prompt": "abc"} if path == C
                                else {"messages": [{"role": "user", "content": "abc"}]})
        for bad in ({"prompt_logprobs": 21}, {"prompt_logprobs": -1},
                    {"prompt_logprobs": "2"}, {"prompt_logprobs": 1, "stream": True},
                    {"prompt_logprobs": 0, "stream": True}):
            status, err, _ = await h.post(path, {**base, **bad})
            assert status == 400 and err["error"]["param"] == "prompt_logprobs", (bad, err)
        if path == C:  # max_tokens 0 needs something scored
            status, err, _ = await h.post(path, {**base, "max_tokens": 0})
            assert status == 400 and err["error"]["param"] == "max_tokens"
