"""Hostile sizes (issue "Hostile input and hostile clients", class 2): nothing a request sends makes
the trio thread tokenize more than a small body. A text the context cannot hold is refused before
tokenizing (400 naming the field); a big body that fits is decoded and tokenized in the prompt
worker thread while the event loop keeps running.

Real clock throughout: the worker is a real thread (STACK.md: autojump_clock would jump while it
runs)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import tokenizers
import trio

from calserve.api import tokenizing
from calserve.api.tokenizing import INLINE_BODY_BYTES, max_text_chars, run_in_worker, worker_limiter
from calserve.models.demo_model import demo_tokenizer_json
from calserve.models.tokenizer import Tokenizer

from .conftest import Harness

HUGE = "a b " * 261000  # just under 1 MiB of JSON body: 1,044,000 characters


@pytest.fixture(scope="module")
def demo_tok() -> Tokenizer:
    return Tokenizer(tokenizers.Tokenizer.from_str(demo_tokenizer_json()))


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The threads ``encode_text`` ran in (the prompts', chat_prompt's and the routes'
    references)."""
    seen: list[str] = []
    real = tokenizing.encode_text

    def spy(tok: Any, text: str, prompt: bool = False) -> tuple[int, ...]:
        seen.append(threading.current_thread().name)
        return real(tok, text, prompt)

    from calserve.api import chat_prompt, prompts, routes
    monkeypatch.setattr(prompts, "encode_text", spy)
    monkeypatch.setattr(chat_prompt, "encode_text", spy)
    monkeypatch.setattr(routes, "encode_text", spy)
    yield seen


def _use(h: Harness, tok: Tokenizer) -> None:
    h.engine._tok = tok  # type: ignore[assignment]  # the package tokenizer, not the byte fake


async def _timed_post(h: Harness, path: str, body: Any) -> tuple[int, Any, float]:
    t0 = time.perf_counter()
    status, out, _ = await h.post(path, body)
    return status, out, time.perf_counter() - t0


def test_the_cap_is_exact_for_byte_level_bpe(demo_tok: Tokenizer) -> None:
    cap = max_text_chars(demo_tok, 2048)
    assert cap == 2048 * max(len(t) for t in demo_tok.backend.get_vocab(with_added_tokens=True))
    # The densest text this tokenizer has (its longest token, repeated) fits right at the cap.
    longest = max(demo_tok.backend.get_vocab(with_added_tokens=True), key=len)
    assert len(demo_tok.encode(longest * 100)) == 100
    assert max_text_chars(object(), 2048) is None  # type: ignore[arg-type]  # unknown: no cap


async def test_prompt_the_context_cannot_hold_is_refused_before_tokenizing(
        harness_factory: Callable[..., Any], demo_tok: Tokenizer, calls: list[str]) -> None:
    async with harness_factory(max_seq=2048) as h:
        _use(h, demo_tok)
        status, out, took = await _timed_post(h, "/v1/completions", {"prompt": HUGE})
        assert status == 400 and out["error"]["param"] == "prompt", out
        assert "context length" in out["error"]["message"]
        msgs = [{"role": "user", "content": "x" * 300000}, {"role": "user", "content": "y"}]
        status, out, took2 = await _timed_post(h, "/v1/chat/completions", {"messages": msgs})
        assert status == 400 and out["error"]["param"] == "messages", out
        status, out, took3 = await _timed_post(h, "/tokenize", {"prompt": "x" * 500000})
        assert status == 400 and out["error"]["param"] == "prompt", out
        status, out, _ = await _timed_post(h, "/tokenize", {"content": "x" * 500000})
        assert status == 400 and out["error"]["param"] == "content", out
        # Token ids: the count decides before any id is looked at.
        status, out, _ = await _timed_post(h, "/v1/completions", {"prompt": [1] * 300000})
        assert status == 400 and out["error"]["param"] == "prompt" and "context" in \
            out["error"]["message"]
    assert calls == []  # nothing was tokenized
    assert max(took, took2, took3) < 0.3, (took, took2, took3)  # tokenizing HUGE took 0.74 s


async def test_big_bodies_are_tokenized_in_the_worker_small_ones_inline(
        harness_factory: Callable[..., Any], demo_tok: Tokenizer, calls: list[str]) -> None:
    async with harness_factory(max_seq=8192, token_delay=0.0) as h:
        _use(h, demo_tok)
        main = threading.current_thread().name
        status, out, _ = await h.post("/v1/completions", {"prompt": "hello", "max_tokens": 2})
        assert status == 200, out
        assert calls == [main]
        big = "the quick brown fox " * 300  # 6,000 characters: over INLINE_BODY_BYTES, fits
        assert len(big) > INLINE_BODY_BYTES
        status, out, _ = await h.post("/v1/completions", {"prompt": big, "max_tokens": 2,
                                                          "echo": True})
        assert status == 200 and out["choices"][0]["text"].startswith(big), out
        status, out, _ = await h.post("/v1/chat/completions", {
            "messages": [{"role": "user", "content": big}], "max_tokens": 2})
        assert status == 200, out
        status, out, _ = await h.post("/tokenize", {"prompt": big})
        assert status == 200 and out["tokens"] == demo_tok.encode(big)
        assert len(calls) == 4 and all(c != main for c in calls[1:]), calls
        # The engine saw exactly the ids the tokenizer gives (the worker's GIL-free batch call).
        assert list(h.engine.submitted[1].prompt_tokens) == demo_tok.encode(big)
        # Errors raised in the worker are answered like inline ones (400 naming the field).
        status, out, _ = await h.post("/v1/chat/completions", {
            "messages": [{"role": "function", "content": big}]})
        assert status == 400 and out["error"]["param"] == "messages[0].role", out
        status, out, _ = await h.post("/v1/completions", {"prompt": big, "max_tokens": 0})
        assert status == 400 and out["error"]["param"] == "max_tokens", out


async def test_the_event_loop_keeps_running_while_a_megabyte_is_tokenized(
        harness_factory: Callable[..., Any], demo_tok: Tokenizer) -> None:
    """A model whose context holds the whole prompt (no cap applies): three ~1 MiB prompts are
    tokenized (0.74 s each) while a ticker measures how late the event loop wakes it."""
    async with harness_factory(max_seq=4_000_000, token_delay=0.0) as h:
        _use(h, demo_tok)
        worst = 0.0
        done = trio.Event()

        async def ticker() -> None:
            nonlocal worst
            last = time.perf_counter()
            while not done.is_set():
                await trio.sleep(0.002)
                now = time.perf_counter()
                worst = max(worst, now - last)
                last = now

        answers: list[int] = []

        async def hostile() -> None:
            status, out, _ = await h.post("/v1/completions", {"prompt": HUGE, "max_tokens": 1})
            answers.append(status)

        async with trio.open_nursery() as n:
            n.start_soon(ticker)
            async with trio.open_nursery() as posts:
                for _ in range(3):
                    posts.start_soon(hostile)
            done.set()
        assert answers == [200, 200, 200]
        assert len(h.engine.submitted[0].prompt_tokens) == 522001
        assert worst < 0.25, worst  # was 3 x 0.74 s in a row on the trio thread


async def test_worker_is_correct_under_cancellation() -> None:
    """A job cancelled while it waits for the worker never runs; one cancelled while it runs is
    waited for and its result dropped; the limiter is never leaked."""
    started = threading.Event()
    release = threading.Event()
    ran: list[str] = []

    def slow() -> str:
        started.set()
        release.wait(5)
        ran.append("slow")
        return "slow"

    def quick() -> str:
        ran.append("quick")
        return "quick"

    lim = worker_limiter()
    assert lim.total_tokens == 1
    async with trio.open_nursery() as n:
        first = trio.CancelScope()
        second = trio.CancelScope()

        async def run(scope: trio.CancelScope, fn: Callable[[], str]) -> None:
            with scope:
                await run_in_worker(fn)

        n.start_soon(run, first, slow)
        await trio.to_thread.run_sync(started.wait, 5)
        n.start_soon(run, second, quick)
        await trio.sleep(0.05)
        assert lim.statistics().tasks_waiting == 1
        second.cancel()  # waiting for the worker: never runs
        first.cancel()  # running: waited for, result dropped
        await trio.sleep(0.05)
        assert ran == []  # the running job is still being waited for
        release.set()
    assert first.cancelled_caught and second.cancelled_caught
    assert ran == ["slow"]
    assert lim.borrowed_tokens == 0
    assert await run_in_worker(quick) == "quick"


def test_a_stream_given_up_for_its_slow_reader_ends_with_client_too_slow() -> None:
    import msgspec

    from calserve.api.chunks import ChunkEncoder
    from calserve.api.stream_encoder import StreamEncoder
    from calserve.engine.types import ErrorEvent, TokenEvent

    enc = StreamEncoder(ChunkEncoder(chat=True, rid="r", created=1, model="m", include_usage=False))
    out = enc.encode([TokenEvent((1,), "a"), ErrorEvent("stream cancelled: ...", "slow_consumer")])
    assert enc.finished and b"[DONE]" not in out
    last = msgspec.json.decode(out.rstrip(b"\n").rsplit(b"\n\n", 1)[-1][len(b"data: "):])
    assert last["error"]["code"] == "client_too_slow", last


async def test_big_detokenize_bodies_are_answered_from_the_worker(
        harness_factory: Callable[..., Any], demo_tok: Tokenizer) -> None:
    async with harness_factory() as h:
        _use(h, demo_tok)
        ids = [i % 250 for i in range(3000)]  # the fake engine's vocabulary is 257
        status, out, _ = await h.post("/detokenize", {"tokens": ids})
        assert status == 200 and out["prompt"] == demo_tok.decode(ids)
        status, out, _ = await h.post("/detokenize", {"tokens": [*ids, 10**6]})
        assert status == 400 and out["error"]["param"] == f"tokens[{len(ids)}]", out
