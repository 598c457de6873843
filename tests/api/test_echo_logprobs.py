"""``echo`` with ``logprobs`` on ``/v1/completions``: every prompt token scored (what evaluation
harnesses ask for: lm-evaluation-harness's ``local-completions`` sends token-id prompts with
``echo``, ``logprobs`` and ``max_tokens`` 0 or 1 and reads ``token_logprobs``/``top_logprobs``).

The fake device's model is a pure function of the sequence so far
(:func:`calserve.testing.fake_device.fake_logits` of its history hash), so each prompt token's
expected logprob is computed here independently of the engine: the scores must be exactly those
numbers (float32 logits, float64 log-sum-exp), whatever the batch, the faults on the way and the
other requests beside it.

Every test runs both ways the engine scores a prompt: from its prefill (the runtime returns every
position's logits, ``capabilities.prompt_logits``: the fake device's sim-next) and by teacher
forcing (a decode step per prompt token: runtimes without it, prompts past
``scheduler.batch.prompt_logits_max_bytes``)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

import calserve.engine.completion as completion_mod
import calserve.engine.sampler as sampler_mod
from calserve.engine.generations import Generation
from calserve.engine.requests import RequestTable
from calserve.runtime.types import FaultKind, JobEngine
from calserve.testing.fake_device import fake_logits, history_hash

from .conftest import make_config
from .real_engine import ChatCharTokenizer, RealHarness, real_app, value
from .test_recovery_metrics import wait_idle
from .sse_util import parse_sse, stream_post

C = "/v1/completions"
TOK = ChatCharTokenizer()


@pytest.fixture(autouse=True, params=["prefill", "teacher"])
def scoring(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """How prompts are scored in this test: "teacher" turns the prefill path off."""
    if request.param == "teacher":
        monkeypatch.setattr(Generation, "scores_in_prefill", lambda self, n: False)
    return str(request.param)
V = TOK.vocab_size


def expected_scores(ids: list[int], k: int) -> list[tuple[float, dict[str, float]]]:
    """(logprob of ids[i], its top-k) for i >= 1 under the fake model, from scratch."""
    out = []
    for i in range(1, len(ids)):
        x = fake_logits(history_hash(ids[:i]), V).astype(np.float64)
        lse = float(x.max() + np.log(np.exp(x - x.max()).sum()))
        order = sorted(range(V), key=lambda t: (-x[t], t))[:k]
        out.append((float(x[ids[i]] - lse), {TOK.decode([t]): float(x[t] - lse) for t in order}))
    return out


def check_scored(lp: dict[str, Any], ids: list[int], k: int) -> None:
    """The prompt's entries of an OpenAI completions ``logprobs`` object."""
    n = len(ids)
    assert lp["tokens"][:n] == [TOK.decode([t]) for t in ids]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for i, (want, tops) in enumerate(expected_scores(ids, k), start=1):
        assert lp["token_logprobs"][i] == pytest.approx(want, abs=1e-5)
        assert lp["top_logprobs"][i].keys() == tops.keys()
        for key, v in tops.items():
            assert lp["top_logprobs"][i][key] == pytest.approx(v, abs=1e-5)
    # offsets: the running length of the token strings, from the start of the echoed prompt
    assert lp["text_offset"] == [sum(len(s) for s in lp["tokens"][:i])
                                 for i in range(len(lp["tokens"]))]


async def post_ok(h: RealHarness, doc: dict[str, Any]) -> dict[str, Any]:
    status, body, _ = await h.post(C, doc)
    assert status == 200, body
    assert isinstance(body, dict)
    return body


async def test_echo_logprobs_scores_the_prompt_then_generates_as_without() -> None:
    async with real_app(make_config()) as h:
        prompt = "hello world"
        ids = TOK.encode(prompt)
        plain = await post_ok(h, {"prompt": prompt, "max_tokens": 5, "temperature": 0,
                                  "logprobs": 2, "ignore_eos": True})
        body = await post_ok(h, {"prompt": prompt, "max_tokens": 5, "temperature": 0,
                                 "logprobs": 2, "echo": True, "ignore_eos": True})
        ch = body["choices"][0]
        assert ch["text"] == prompt + plain["choices"][0]["text"]
        assert ch["finish_reason"] == "length"
        lp = ch["logprobs"]
        check_scored(lp, ids, 2)
        gen = plain["choices"][0]["logprobs"]
        n = len(ids)
        assert lp["tokens"][n:] == gen["tokens"]  # the completion is the one it was without echo
        assert lp["token_logprobs"][n:] == gen["token_logprobs"]
        assert lp["top_logprobs"][n:] == gen["top_logprobs"]
        assert body["usage"] == {"prompt_tokens": n, "completion_tokens": 5, "total_tokens": n + 5}


async def test_how_a_prompt_is_scored_prefill_or_teacher_forcing(scoring: str) -> None:
    """From the prefill, a scored request's decode steps are only its completion's; by teacher
    forcing, one more per prompt token after the first. Prompts whose logits exceed
    ``scheduler.batch.prompt_logits_max_bytes`` (here 5 positions) take teacher forcing."""
    cfg = make_config(scheduler={"batch": {"prompt_logits_max_bytes": 4 * V * 5}})
    async with real_app(cfg) as h:
        for text in ("abcde", "abcdefghij"):
            ids = TOK.encode(text)
            body = await post_ok(h, {"prompt": ids, "max_tokens": 3, "logprobs": 1, "echo": True,
                                     "temperature": 0, "ignore_eos": True})
            check_scored(body["choices"][0]["logprobs"], ids, 1)
            trace = h.real_engine.core.requests.trace
            rid = next(r[0] for kind, r in reversed(trace) if kind == "prefill")
            prefills = [r for kind, r in trace if kind == "prefill" and rid in r]
            steps = sum(1 for kind, r in trace if kind == "decode" and rid in r)
            whole = scoring == "prefill" and len(ids) <= 5
            assert len(prefills) == 1
            assert steps == (2 if whole else len(ids) - 1 + 2), (text, scoring, steps)


async def test_max_tokens_zero_scores_only_and_needs_echo_with_logprobs() -> None:
    async with real_app(make_config()) as h:
        ids = TOK.encode("abcdefg")
        body = await post_ok(h, {"prompt": ids, "max_tokens": 0, "logprobs": 1, "echo": True})
        ch = body["choices"][0]
        assert ch["text"] == TOK.decode(ids) and ch["finish_reason"] == "length"
        assert len(ch["logprobs"]["tokens"]) == len(ids)
        check_scored(ch["logprobs"], ids, 1)
        assert body["usage"]["completion_tokens"] == 0
        for doc in ({"prompt": "abc", "max_tokens": 0},
                    {"prompt": "abc", "max_tokens": 0, "echo": True},
                    {"prompt": "abc", "max_tokens": 0, "logprobs": 1}):
            status, err, _ = await h.post(C, doc)
            assert status == 400 and err["error"]["param"] == "max_tokens", err
        # a one-token prompt: nothing to score but its null entry
        body = await post_ok(h, {"prompt": [5], "max_tokens": 0, "logprobs": 0, "echo": True})
        lp = body["choices"][0]["logprobs"]
        assert lp["tokens"] == [TOK.decode([5])] and lp["token_logprobs"] == [None]
        body = await post_ok(h, {"prompt": [5], "max_tokens": 2, "logprobs": 0, "echo": True,
                                 "ignore_eos": True, "temperature": 0})
        lp = body["choices"][0]["logprobs"]
        assert len(lp["tokens"]) == 3 and lp["token_logprobs"][0] is None
        assert all(isinstance(v, float) for v in lp["token_logprobs"][1:])


async def test_lm_eval_style_batch_of_token_prompts() -> None:
    """lm-evaluation-harness's loglikelihood request: token-id prompts in one call, echo,
    logprobs 1, max_tokens 0 (or 1), temperature 0; it reads token_logprobs[ctxlen:] and
    top_logprobs for the greedy check."""
    async with real_app(make_config()) as h:
        prompts = [TOK.encode(s) for s in ("the cat sat", "on the mat", "x", "a b c d e f g h")]
        for mt in (0, 1):
            body = await post_ok(h, {"prompt": prompts, "max_tokens": mt, "logprobs": 1,
                                     "echo": True, "temperature": 0})
            assert [c["index"] for c in body["choices"]] == list(range(len(prompts)))
            for c, ids in zip(body["choices"], prompts, strict=True):
                assert len(c["logprobs"]["tokens"]) == len(ids) + mt
                check_scored(c["logprobs"], ids, 1)
                # what the harness computes of a (context, continuation) split of the prompt
                ctxlen = max(1, len(ids) // 2)
                end = len(ids)  # the prompt's entries ([ctxlen:-1] with max_tokens 1)
                lps = c["logprobs"]["token_logprobs"][ctxlen:end]
                tops = c["logprobs"]["top_logprobs"][ctxlen:end]
                want = expected_scores(ids, 1)[ctxlen - 1:]
                assert sum(lps) == pytest.approx(sum(w for w, _ in want), abs=1e-4)
                greedy = all(t == max(top.values()) for t, top in zip(lps, tops, strict=True))
                assert greedy == all(v == pytest.approx(max(tp.values()), abs=1e-9)
                                     for v, tp in want)
            assert body["usage"]["prompt_tokens"] == sum(map(len, prompts))
            assert body["usage"]["completion_tokens"] == mt * len(prompts)


async def test_streamed_echo_logprobs_accumulate_to_the_unstreamed_answer() -> None:
    async with real_app(make_config()) as h:
        doc = {"prompt": "stream me", "max_tokens": 4, "logprobs": 3, "echo": True,
               "temperature": 0, "ignore_eos": True}
        whole = (await post_ok(h, doc))["choices"][0]
        status, raw = await stream_post(h.client, C, {**doc, "stream": True})
        assert status == 200
        events = parse_sse(raw)
        assert events[-1] == "[DONE]"
        text = ""
        acc: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                     "text_offset": []}
        for ev in events[:-1]:
            ch = ev["choices"][0]
            text += ch["text"]
            if ch["logprobs"]:
                for key in acc:
                    acc[key] += ch["logprobs"][key]
        assert text == whole["text"]
        assert acc == whole["logprobs"]


async def test_scores_survive_faults_and_company(autojump_clock: Any,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Scoring requests beside plain ones, some cancelled by their deadline, with device faults
    on the way (transparent recovery re-prefills a scoring request up to its pending input): every
    score is still the model's, every request ends once, every lane comes back."""
    lost_scoring: list[int] = []
    park_lost = RequestTable.park_lost

    def spy(self: RequestTable, s: Any, retries: int) -> bool:
        if s.score_upto is not None:
            lost_scoring.append(s.rid)
        return park_lost(self, s, retries)

    monkeypatch.setattr(RequestTable, "park_lost", spy)
    cfg = make_config(scheduler={"recovery": {"max_request_retries": 3},
                                 "batch": {"profiles": [1, 4, 8]}})
    async with real_app(cfg) as h:
        prompts = ["score this one", "and that", "q", "a longer prompt to score here"]
        results: dict[int, tuple[int, Any]] = {}

        async def one(i: int) -> None:
            doc: dict[str, Any] = {"prompt": prompts[i % len(prompts)], "max_tokens": 3,
                                   "logprobs": 2, "echo": True, "temperature": 0,
                                   "ignore_eos": True}
            if i % 3 == 1:
                doc = {"prompt": "plain", "max_tokens": 6, "ignore_eos": True}
            status, body, _ = await h.post(C, doc)
            results[i] = (status, body)

        h.backend.inject_fault(FaultKind.CCU_FAULT, JobEngine.PING, 5)
        async with trio.open_nursery() as n:
            for i in range(12):
                n.start_soon(one, i)
                await trio.sleep(0.0005)
        h.backend.inject_fault(FaultKind.CCU_FAULT, JobEngine.PING, 2)
        async with trio.open_nursery() as n:
            for i in range(12, 20):
                n.start_soon(one, i)
        for i, (status, body) in sorted(results.items()):
            assert status == 200, body
            if i % 3 == 1:
                continue
            ids = TOK.encode(prompts[i % len(prompts)])
            check_scored(body["choices"][0]["logprobs"], ids, 2)
        assert lost_scoring  # a fault took a request in the middle of scoring its prompt
        trace = h.real_engine.core.requests.trace
        assert any(kind == "decode" and len(r) >= 3 for kind, r in trace)  # in batches
        m = await wait_idle(h)  # every lane, slot and job back
        assert value(m, "calserve_resets_total") >= 1
        assert not h.real_engine.core.requests.scoring  # nothing left marked as scoring


@settings(max_examples=25, deadline=None)
@given(text=st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=122), min_size=1,
                    max_size=12),
       k=st.integers(0, 5), mt=st.integers(0, 3))
def test_scores_are_the_models_for_any_prompt(text: str, k: int, mt: int) -> None:
    async def main() -> None:
        async with real_app(make_config()) as h:
            ids = TOK.encode(text)
            body = await post_ok(h, {"prompt": ids, "max_tokens": mt, "logprobs": k,
                                     "echo": True, "temperature": 0, "ignore_eos": True})
            lp = body["choices"][0]["logprobs"]
            assert len(lp["tokens"]) == len(ids) + mt
            check_scored(lp, ids, k)

    trio.run(main)


async def test_a_scoring_failure_fails_that_request_alone(monkeypatch: pytest.MonkeyPatch,
                                                          scoring: str) -> None:
    """Defence in depth: scoring that raises for one request's lane (here: asked for 4
    alternatives) ends that request with an error; the others in its batches and the engine
    carry on. (From its prefill: the one scoring call of that request's prefill fails.)"""
    real = sampler_mod.score_tokens
    calls = [0]
    teacher = scoring == "teacher"

    def flaky(rows: Any, tokens: Any, ks: Any) -> Any:
        if 4 in ks:  # teacher forcing: from its fourth step on, once in batches with the others
            calls[0] += 1
            if calls[0] > (3 if teacher else 0):
                raise FloatingPointError("injected")
        return real(rows, tokens, ks)

    monkeypatch.setattr(completion_mod, "score_tokens", flaky)
    prompt = "a prompt long enough for several to be scored in one batch"
    ks = (1, 4, 2, 3, 0, 2, 1, 3)
    async with real_app(make_config(scheduler={"batch": {"profiles": [1, 4, 8]}})) as h:
        results: dict[int, tuple[int, Any]] = {}

        async def one(i: int) -> None:
            status, body, _ = await h.post(C, {"prompt": prompt, "max_tokens": 2,
                                               "logprobs": ks[i], "echo": True, "temperature": 0})
            results[i] = (status, body)

        async with trio.open_nursery() as n:
            for i in range(len(ks)):
                n.start_soon(one, i)
        trace = h.real_engine.core.requests.trace
        if teacher:
            assert any(kind == "decode" and len(r) >= 3 for kind, r in trace), trace  # batched
            assert calls[0] > 4  # it failed in a batch, then alone
        else:
            assert calls[0] == 1  # its prefill's scoring, once
        for i, k in enumerate(ks):
            status, body = results[i]
            if k == 4:
                assert status == 500 and body["error"]["code"] == "internal_error", body
            else:
                assert status == 200, body
                check_scored(body["choices"][0]["logprobs"], TOK.encode(prompt), k)
        assert h.real_engine.ready()
