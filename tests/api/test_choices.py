"""``n`` > 1 through the HTTP layer (api/choices.py): n independent sequences, each its own engine
request (admitted, charged, cancelled like one), indexed choices, usage summed, one ``[DONE]``."""

from __future__ import annotations

from typing import Any

import msgspec
import trio
from hypothesis import given
from hypothesis import strategies as st

from calserve.api.convert import Prepared, choice_seed
from calserve.engine.sampler import uniform_for
from calserve.engine.types import GenerateRequest, SamplingParams

from .conftest import Harness, make_config
from .real_engine import real_app
from .sse_util import parse_sse, stream_post

C = "/v1/completions"
CH = "/v1/chat/completions"
MSGS = [{"role": "user", "content": "hello"}]


def stream_texts(events: list[Any], chat: bool) -> dict[int, str]:
    out: dict[int, str] = {}
    for ev in events:
        if ev == "[DONE]" or not ev["choices"]:
            continue
        ch = ev["choices"][0]
        piece = ch["delta"].get("content") if chat else ch["text"]
        out[ch["index"]] = out.get(ch["index"], "") + (piece or "")
    return out


async def test_n_choices_json_are_indexed_summed_independent_and_reproducible() -> None:
    async with real_app(make_config()) as h:
        before = h.real_engine.statistics().admitted_total
        doc = {"prompt": "hello", "max_tokens": 6, "temperature": 1.0, "seed": 11, "n": 4,
               "ignore_eos": True}
        status, body, _ = await h.post(C, doc)
        assert status == 200, body
        assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
        texts = [c["text"] for c in body["choices"]]
        assert len(set(texts)) > 1  # independent sequences (derived seeds)
        assert body["usage"]["completion_tokens"] == 4 * 6
        assert body["usage"]["prompt_tokens"] == len("hello")  # the prompt once
        assert h.real_engine.statistics().admitted_total - before == 4  # one request per choice
        status, again, _ = await h.post(C, doc)  # same seed: the same choices
        assert [c["text"] for c in again["choices"]] == texts
        status, one, _ = await h.post(C, {**doc, "n": 1})
        assert one["choices"][0]["text"] == texts[0]  # choice 0 is the n=1 answer
        # chat, the same way
        status, chat, _ = await h.post(CH, {"messages": MSGS, "max_tokens": 5, "seed": 3, "n": 3,
                                            "temperature": 1.0})
        assert status == 200 and [c["index"] for c in chat["choices"]] == [0, 1, 2]
        assert all(c["message"]["role"] == "assistant" for c in chat["choices"])


async def test_n_choices_stream_index_their_chunks_and_end_with_one_done() -> None:
    async with real_app(make_config()) as h:
        for path, base, chat in ((C, {"prompt": "hello"}, False), (CH, {"messages": MSGS}, True)):
            doc = {**base, "max_tokens": 7, "temperature": 1.0, "seed": 5, "n": 3,
                   "ignore_eos": True}
            _, body, _ = await h.post(path, doc)
            want = {c["index"]: (c["message"]["content"] if chat else c["text"])
                    for c in body["choices"]}
            status, raw = await stream_post(h.client, path, {
                **doc, "stream": True, "stream_options": {"include_usage": True}})
            assert status == 200
            events = parse_sse(raw)
            assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
            usage = events[-2]
            assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 21
            assert stream_texts(events, chat) == want  # the same answers as the JSON response
            finishes = [ev["choices"][0]["index"] for ev in events[:-2]
                        if ev["choices"][0]["finish_reason"] is not None]
            assert sorted(finishes) == [0, 1, 2]
            assert len({ev["id"] for ev in events[:-1]}) == 1
            if chat:
                roles = [ev["choices"][0]["index"] for ev in events[:-2]
                         if ev["choices"][0]["delta"].get("role")]
                assert sorted(roles) == [0, 1, 2]
        assert h.real_engine.ready()


async def test_n_is_bounded_by_server_max_n() -> None:
    async with real_app(make_config(server={"max_n": 2})) as h:
        status, body, _ = await h.post(C, {"prompt": "hi", "max_tokens": 2, "n": 3})
        assert status == 400 and body["error"]["param"] == "n"
        status, body, _ = await h.post(C, {"prompt": "hi", "max_tokens": 2, "n": 2})
        assert status == 200 and len(body["choices"]) == 2
        status, body, _ = await h.post(C, {"prompt": "hi", "max_tokens": 2, "n": 2, "best_of": 2})
        assert status == 400 and body["error"]["param"] == "best_of"


async def test_a_prompt_list_answers_each_prompt_as_alone_in_order_json_and_stream() -> None:
    """``prompt`` as a list: choice k * n + j is choice j of prompt k, the same answer as that
    prompt alone with the same seed; usage counts each prompt once; each choice is a request."""
    async with real_app(make_config()) as h:
        base = {"max_tokens": 5, "temperature": 1.0, "seed": 7, "n": 2, "ignore_eos": True}
        prompts = ["hello", "a longer prompt"]
        alone = []
        for p in prompts:
            status, body, _ = await h.post(C, {**base, "prompt": p})
            assert status == 200, body
            alone += [c["text"] for c in body["choices"]]
        before = h.real_engine.statistics().admitted_total
        status, body, _ = await h.post(C, {**base, "prompt": prompts})
        assert status == 200, body
        assert h.real_engine.statistics().admitted_total - before == 4
        assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
        assert [c["text"] for c in body["choices"]] == alone
        assert body["usage"] == {"prompt_tokens": len("hello") + len("a longer prompt"),
                                 "completion_tokens": 20, "total_tokens": 40}
        # token-id lists, echoed: each choice starts with its own prompt's text
        ids = []
        for text in ("hi", "ok!"):
            status, tk, _ = await h.post("/tokenize", {"prompt": text})
            ids.append(tk["tokens"])
        status, body, _ = await h.post(C, {**base, "n": 1, "prompt": ids, "echo": True})
        assert status == 200, body
        assert [c["text"][:len(t)] for c, t in zip(body["choices"], ["hi", "ok!"])] == ["hi", "ok!"]
        # streamed: the same answers, indexed, one usage chunk, one [DONE]
        status, raw = await stream_post(h.client, C, {
            **base, "prompt": prompts, "stream": True, "stream_options": {"include_usage": True}})
        assert status == 200
        events = parse_sse(raw)
        assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
        usage = events[-2]["usage"]
        assert usage["prompt_tokens"] == 20 and usage["completion_tokens"] == 20
        assert stream_texts(events, False) == dict(enumerate(alone))
        assert h.real_engine.ready()


async def test_a_prompt_list_refuses_a_bad_item_by_name_and_is_bounded() -> None:
    async with real_app(make_config(server={"max_prompts": 3})) as h:
        cases: list[tuple[Any, str]] = [
            (["a", "b", "c", "d"], "prompt"), (["a", ""], "prompt[1]"), (["a", [1]], "prompt[1]"),
            ([[1], "a"], "prompt[1]"), ([[1], []], "prompt[1]"), ([[1], [1, 999]], "prompt[1][1]"),
            (["a", "b" * 10**5], "prompt[1]"),
        ]
        for prompt, param in cases:
            status, body, _ = await h.post(C, {"prompt": prompt, "max_tokens": 2})
            assert status == 400 and body["error"]["param"] == param, (prompt, body)
        status, body, _ = await h.post(C, {"prompt": ["a", "b", "c"], "max_tokens": 2})
        assert status == 200 and len(body["choices"]) == 3
        # chat has no prompt list; a batched chat body is not a thing (messages is one conversation)
        assert h.real_engine.ready()


async def test_a_refused_choice_refuses_the_request_and_frees_the_others(
        harness_factory: Any, autojump_clock: Any) -> None:
    async with harness_factory(token_delay=0.01, max_running=2) as h:
        status, body, _ = await h.post(C, {"prompt": "x", "max_tokens": 5, "n": 3})
        assert status == 429, body
        await trio.sleep(0.1)
        assert h.engine.active == {}  # the two admitted choices were cancelled at once
        assert len(h.engine.cancelled_ids) == 2


async def test_disconnect_cancels_every_choice(harness_factory: Any, autojump_clock: Any) -> None:
    for stream in (True, False):
        async with harness_factory(token_delay=1.0) as h:
            assert isinstance(h, Harness)
            conn = h.client.request(path=C, method="POST",
                                    headers={"content-type": "application/json"})
            async with conn as c:
                await c.send(msgspec.json.encode({"prompt": "x", "max_tokens": 400, "n": 3,
                                                  "stream": stream}))
                await c.send_complete()
                await trio.sleep(3.5)
                assert len(h.engine.active) == 3
                rids = set(h.engine.active)
                await c.disconnect()
                c._client_send.close()  # type: ignore[attr-defined]
            await trio.sleep(0.01)
            assert rids <= set(h.engine.cancelled_ids) and h.engine.active == {}
            text = await (await h.client.get("/metrics")).get_data(as_text=True)
            assert "calserve_streams_active 0.0" in text


async def test_an_error_in_one_choice_ends_the_stream_without_done(harness_factory: Any,
                                                                   autojump_clock: Any) -> None:
    async with harness_factory(token_delay=0.01, fail_after_tokens=3) as h:
        status, raw = await stream_post(h.client, C, {"prompt": "x", "max_tokens": 9, "n": 2,
                                                      "stream": True})
        assert status == 200
        events = parse_sse(raw)
        assert "[DONE]" not in events and "error" in events[-1]
        await trio.sleep(0.1)
        assert h.engine.active == {}
        status, body, _ = await h.post(C, {"prompt": "x", "max_tokens": 9, "n": 2})
        assert status >= 500 and body["error"]["code"]


@given(seed=st.integers(-(2**63), 2**63 - 1), n=st.integers(2, 8))
def test_choice_seeds_are_distinct_reproducible_int64_and_draw_independently(seed: int,
                                                                             n: int) -> None:
    seeds = [seed] + [choice_seed(seed, i) for i in range(1, n)]
    assert seeds == [seed] + [choice_seed(seed, i) for i in range(1, n)]  # a pure function
    assert len(set(seeds)) == n
    assert all(-(2**63) <= s < 2**63 for s in seeds)
    # the choices' counter-based variates are unrelated streams: no two choices share a step's u
    draws = [tuple(uniform_for(s, step) for step in range(4)) for s in seeds]
    assert len(set(draws)) == n
    prep = Prepared("completion", "m", GenerateRequest((1, 2), SamplingParams(seed=seed)),
                    False, False, "", None, n)
    reqs = prep.choice_requests()
    assert [r.sampling.seed for r in reqs] == seeds
    assert all(r.prompt_tokens == (1, 2) for r in reqs)
    unseeded = Prepared("chat", "m", GenerateRequest((1,)), False, False, "", None, n)
    assert [r.sampling.seed for r in unseeded.choice_requests()][1:] == [None] * (n - 1)
