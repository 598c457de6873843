"""The sampler's logits processors (engine/logits.py + sampler.py): penalties, logit_bias, min_p.

Properties (hypothesis): each processor moves the logits the way OpenAI/vLLM define it; over a
generation, penalties change how often tokens repeat in the right direction; a bias of -100 bans a
token and +100 forces it; min_p keeps only tokens at least min_p x as likely as the best; a lane's
draw depends on its own settings only (not its batch-mates); and lanes without processors draw
exactly what they drew before (an empty processor set changes nothing).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from calserve.engine.logits import LaneHistory, LaneLogits, apply_processors
from calserve.engine.sampler import LaneSampling, sample_batch

VOCAB = 24


def logits_rows(seed: int, n: int, vocab: int = VOCAB, scale: float = 2.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((n, vocab)) * scale).astype(np.float32)


def generate(row: np.ndarray, steps: int, seed: int, *, freq: float = 0.0, pres: float = 0.0,
             rep: float = 1.0, temperature: float = 1.0) -> list[int]:
    """A toy generation: the same logits every step, processed by the request's own history."""
    toks: list[int] = []
    for step in range(steps):
        proc = LaneLogits.from_history(toks, [0, 1], presence_penalty=pres,
                                       frequency_penalty=freq, repetition_penalty=rep)
        ln = LaneSampling(temperature=temperature, seed=seed, step=step, logits=proc)
        toks.append(int(sample_batch(row[None, :], [ln]).tokens[0]))
    return toks


def distinct(row: np.ndarray, seed: int, **kw: float) -> int:
    """Distinct tokens over four 48-token generations from ``row`` (sampling seeds seed..seed+3):
    fewer when the same tokens come back more often."""
    return sum(len(set(generate(row, 48, seed + j, **kw))) for j in range(4))


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 4))
@example(seed=3515)
def test_penalties_change_repetition_in_the_right_direction(seed: int) -> None:
    """Sampling is random, so the direction is asserted over four generations (same sampling seeds
    with and without the penalty), and repetition is counted as distinct tokens, what presence
    penalises. One generation per seed, or the sum of squared counts, is not monotone: a random-seed
    run found seed 3515, where repetition_penalty 0.2 also boosts the prompt's tokens and the one
    dominant token shares its steps with them (fewer repeats of it, more tokens repeated); checked
    on 1,500 more seeds without a counterexample."""
    row = logits_rows(seed, 1)[0]
    base = distinct(row, seed)
    for kw in ({"freq": 2.0}, {"pres": 2.0}, {"rep": 3.0}):
        assert distinct(row, seed, **kw) >= base, kw
    for kw in ({"freq": -2.0}, {"pres": -2.0}, {"rep": 0.2}):
        assert distinct(row, seed, **kw) <= base, kw


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), freq=st.floats(-2, 2), pres=st.floats(-2, 2),
       rep=st.floats(0.01, 10), hist=st.lists(st.integers(0, VOCAB - 1), max_size=30),
       prompt=st.lists(st.integers(0, VOCAB - 1), max_size=10))
def test_penalties_are_openai_and_vllm_formulas(seed: int, freq: float, pres: float, rep: float,
                                                hist: list[int], prompt: list[int]) -> None:
    x = logits_rows(seed, 1)
    got = apply_processors(x, [LaneLogits.from_history(
        hist, prompt, presence_penalty=pres, frequency_penalty=freq, repetition_penalty=rep)])[0]
    counts = np.bincount(np.asarray(hist, np.int64), minlength=VOCAB).astype(np.float32)
    seen = np.zeros(VOCAB, bool)
    seen[list(set(hist) | set(prompt))] = True
    want = x[0].copy()
    pen = np.float32(rep)
    want = np.where(seen, np.where(want > 0, want / pen, want * pen), want).astype(np.float32)
    want -= np.float32(freq) * counts + np.float32(pres) * (counts > 0)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert np.array_equal(got[~seen], x[0][~seen])  # tokens never seen are untouched


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**63 - 1), banned=st.integers(0, VOCAB - 1),
       temperature=st.sampled_from([0.0, 0.3, 1.0, 2.0]), top_p=st.sampled_from([1.0, 0.9]),
       top_k=st.sampled_from([0, 5]), min_p=st.sampled_from([0.0, 0.05]))
def test_logit_bias_minus_100_bans_and_plus_100_forces(seed: int, banned: int, temperature: float,
                                                       top_p: float, top_k: int,
                                                       min_p: float) -> None:
    x = logits_rows(seed % 2**32, 8, scale=3.0)
    x[:, banned] = x.max(axis=1) + 5.0  # the favourite of every row, before the bias
    ban = LaneLogits.from_history([], logit_bias=[(banned, -100.0)])
    force = LaneLogits.from_history([], logit_bias=[((banned + 1) % VOCAB, 100.0)])
    for step in range(8):
        lanes = [LaneSampling(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                              seed=seed, step=step, logits=ban) for _ in range(4)]
        lanes += [LaneSampling(temperature=temperature, seed=seed, step=step, logits=force,
                               top_k=top_k) for _ in range(4)]
        toks = sample_batch(x, lanes).tokens
        assert banned not in toks[:4].tolist()
        assert toks[4:].tolist() == [(banned + 1) % VOCAB] * 4


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**63 - 1), min_p=st.floats(0.01, 1.0),
       temperature=st.sampled_from([0.5, 1.0, 1.7]), top_k=st.sampled_from([0, 3, 20]),
       top_p=st.sampled_from([1.0, 0.7]))
def test_min_p_keeps_only_tokens_near_the_best(seed: int, min_p: float, temperature: float,
                                               top_k: int, top_p: float) -> None:
    x = logits_rows(seed % 2**32, 1, scale=2.0)
    p = np.exp((x[0] - x[0].max()) / temperature)  # relative to the best token
    rank = np.argsort(-x[0], kind="stable")
    for step in range(20):
        t = int(sample_batch(x, [LaneSampling(temperature=temperature, min_p=min_p, seed=seed,
                                              step=step, top_k=top_k, top_p=top_p)]).tokens[0])
        assert p[t] >= min_p * (1 - 1e-6)
        if top_k:
            assert t in rank[:top_k].tolist()


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**63 - 1), lane=st.integers(0, 5),
       hist=st.lists(st.integers(0, VOCAB - 1), max_size=12))
def test_a_lane_draws_the_same_alone_or_in_any_batch(seed: int, lane: int, hist: list[int]) -> None:
    x = logits_rows(seed % 2**32, 6)
    procs = [None, LaneLogits.from_history(hist, frequency_penalty=1.0),
             LaneLogits.from_history(hist, repetition_penalty=1.5, logit_bias=[(3, 5.0)]),
             None, LaneLogits.from_history([], presence_penalty=-1.0), None]
    lanes = [LaneSampling(temperature=[0.0, 1.0, 0.7, 1.0, 0.0, 1.3][i], seed=seed + i, step=4,
                          logits=procs[i], min_p=0.02 * (i % 2), logprobs=2 if i == 3 else None)
             for i in range(6)]
    together = sample_batch(x, lanes)
    alone = sample_batch(x[lane:lane + 1], [lanes[lane]])
    assert together.tokens[lane] == alone.tokens[0]
    if lanes[lane].logprobs is not None:
        assert together.logprobs[lane] == alone.logprobs[0]


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**63 - 1), temperature=st.sampled_from([0.0, 0.8, 1.0]),
       top_k=st.sampled_from([0, 4]), top_p=st.sampled_from([1.0, 0.8]))
def test_no_processor_draws_exactly_what_it_drew_before(seed: int, temperature: float,
                                                        top_k: int, top_p: float) -> None:
    x = logits_rows(seed % 2**32, 3)
    plain = [LaneSampling(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, step=s,
                          logprobs=1) for s in range(3)]
    empty = [LaneSampling(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, step=s,
                          logprobs=1, logits=LaneLogits()) for s in range(3)]
    a, b = sample_batch(x, plain), sample_batch(x, empty)
    assert a.tokens.tolist() == b.tokens.tolist()
    assert a.logprobs == b.logprobs  # logprobs are of the raw logits either way


def test_logprobs_stay_those_of_the_raw_logits() -> None:
    x = logits_rows(5, 1)
    ban = LaneLogits.from_history([], logit_bias=[(int(x[0].argmax()), -100.0)])
    r = sample_batch(x, [LaneSampling(temperature=0.0, logprobs=0, logits=ban)])
    t = int(r.tokens[0])
    assert t != int(x[0].argmax())
    lse = np.log(np.exp(x[0].astype(np.float64) - x[0].max()).sum()) + x[0].max()
    assert r.logprobs[0] is not None
    assert r.logprobs[0].logprob == pytest.approx(float(x[0, t]) - lse, abs=1e-5)


@given(tokens=st.lists(st.integers(0, 50), max_size=60), cut=st.integers(0, 60))
def test_history_caught_up_incrementally_equals_counted_from_scratch(tokens: list[int],
                                                                     cut: int) -> None:
    prompt = np.array([3, 4, 4, 7], np.int64)
    h = LaneHistory(prompt, True)
    h.sync(tokens[:cut])
    h.sync(tokens)  # catches up
    fresh = LaneHistory(prompt, True)
    fresh.sync(tokens)
    for a, b in ((h, fresh),):
        assert dict(zip(a.ids[:a.n].tolist(), a.counts[:a.n].tolist(), strict=True)) == \
            dict(zip(b.ids[:b.n].tolist(), b.counts[:b.n].tolist(), strict=True))
        assert sorted(a.seen[:a.n_seen].tolist()) == sorted(set(tokens) | {3, 4, 7})
    h.sync(tokens[:cut // 2])  # a shorter list (never in the engine): counted again from scratch
    again = LaneHistory(prompt, True)
    again.sync(tokens[:cut // 2])
    assert h.n == again.n and h.counts[:h.n].tolist() == again.counts[:again.n].tolist()
