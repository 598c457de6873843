"""The load generator against a real HTTP server on 127.0.0.1 (the bare floor app as a fake OpenAI
server, under hypercorn's trio worker in this process): records and summary must account for every
request, agree with what the server saw, and have ordered percentiles."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.floor_app import FloorApp, FloorOptions, serve_floor
from bench.loadgen import LoadSpec, build_parser, run_load, save_run, spec_from_args
from bench.report import report
from bench.summary import OUTCOMES, Record, read_records, summarize
from bench.workload import Lengths, TenantSpec, arrivals


async def _server(nursery: trio.Nursery, **opts: object) -> tuple[FloorApp, str]:
    app = FloorApp(FloorOptions(**opts))  # type: ignore[arg-type]
    port = await nursery.start(serve_floor, app)
    return app, f"http://127.0.0.1:{port}"


def _check_stats(stats: dict[str, float]) -> None:
    if stats["count"]:
        assert stats["min"] <= stats["p50"] <= stats["p90"] <= stats["p99"] <= stats["max"]
        # the mean of equal values may round 1 ulp past them (sum / n): a relative tolerance
        tol = 1e-12 * max(abs(stats["min"]), abs(stats["max"]), 1e-300)
        assert stats["min"] - tol <= stats["mean"] <= stats["max"] + tol


def _check_consistent(recs: list[Record], s: dict[str, object]) -> None:
    assert s["sent"] == len(recs)
    assert [r.index for r in recs] == list(range(len(recs)))
    outcomes = s["outcomes"]
    assert isinstance(outcomes, dict) and sum(outcomes.values()) == len(recs)
    assert set(outcomes) == set(OUTCOMES)
    for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        _check_stats(s[k])  # type: ignore[arg-type]
    for r in recs:
        assert r.outcome in OUTCOMES
        assert r.e2e is not None and r.e2e >= 0
        assert r.token_times == sorted(r.token_times)
        if r.token_times:
            assert r.ttft == r.token_times[0] and r.token_times[-1] <= r.e2e + 1e-6
        if r.outcome == "ok":
            assert r.status == 200 and r.error is None
    ok = [r for r in recs if r.outcome == "ok"]
    assert s["output_tokens"] == sum(r.output_tokens for r in ok)
    assert math.isclose(s["output_throughput"], s["output_tokens"] / s["duration_s"])  # type: ignore
    tenants = s["tenants"]
    assert isinstance(tenants, dict) and sum(t["sent"] for t in tenants.values()) == len(recs)


async def test_open_and_closed_loop_accounting(nursery: trio.Nursery) -> None:
    """Two tenants (Poisson + closed loop), a concurrency cap that rejects, injected mid-stream
    errors: every request has one outcome, and the counts match the server's own."""
    app, url = await _server(nursery, token_delay_s=0.002, max_inflight=6, error_every=5)
    spec = LoadSpec(
        base_url=url,
        tenants=(TenantSpec("a", "key-a", rate=60, output_len=Lengths(4, 24)),
                 TenantSpec("b", None, concurrency=3, output_len=Lengths(16, 16))),
        duration_s=2.0, progress=False, scrape_interval_s=0.25, slo_ttft_ms=1000, slo_tpot_ms=50,
    )
    t0 = trio.current_time()
    res = await run_load(spec)
    assert trio.current_time() - t0 < 2.0 + spec.drain_timeout_s
    recs, s = res.records, res.summary
    _check_consistent(recs, s)
    oc = s["outcomes"]
    assert oc["rejected"] == app.rejected > 0  # the cap was hit and every 429 was seen as rejected
    assert oc["ok"] == app.completed > 0
    assert oc["failed"] >= 1 and all(r.error == "injected fault" for r in recs
                                      if r.outcome == "failed")
    assert oc["ok"] + oc["failed"] + oc["rejected"] == app.requests == len(recs)
    assert all(r.status == 429 for r in recs if r.outcome == "rejected")
    for r in recs:
        if r.outcome == "ok":  # ignore_eos + max_tokens pin the length; usage agrees with events
            assert r.output_tokens == len(r.token_times) and r.finish_reason == "length"
    assert all(r.planned <= 2.0 for r in recs)
    assert {r.tenant for r in recs} == {"a", "b"}
    assert s["good_requests"] <= oc["ok"]
    # fake calserve metrics were scraped
    assert res.metrics and s["batch_fill"]["samples"] > 0
    svc = s["service_over_time"]["tokens_per_s"]
    total = sum(sum(v) for v in svc.values()) * s["service_over_time"]["bin_s"]
    delivered = sum(t["output_tokens_delivered"] for t in s["tenants"].values())
    assert math.isclose(total, delivered, rel_tol=1e-6)
    assert s["window"]["end_s"] == 2.0 and 0 < s["window"]["output_tokens"] <= delivered
    assert s["window"]["batch_fill"] is not None and 0 < s["window"]["batch_fill"] <= 1
    # steady TPOT: the requests sent inside the window, a subset of all
    wt, at = s["window"]["tpot_ms"], s["tpot_ms"]
    sent_in = [r for r in recs if s["window"]["start_s"] <= r.start < 2.0 and r.tpot is not None]
    assert wt["count"] == len(sent_in) and 0 < wt["count"] <= at["count"]
    assert wt["min"] <= wt["p50"] <= wt["p99"] <= wt["max"] and at["min"] <= wt["min"]
    # content bytes: every content event carries at least a "data: {}\n\n"
    assert all(r.content_bytes >= 10 * len(r.token_times) for r in recs)


async def test_request_count_bound_nonstreaming_and_seed(nursery: trio.Nursery, tmp_path: Path) -> None:
    _, url = await _server(nursery, token_delay_s=0.0005)

    def spec(seed: int, stream: bool) -> LoadSpec:
        return LoadSpec(base_url=url, tenants=(TenantSpec(rate=200, prompt_len=Lengths(3, 40),
                                                          output_len=Lengths(2, 9)),),
                        num_requests=25, stream=stream, seed=seed, progress=False,
                        scrape_interval_s=None)

    a = await run_load(spec(7, True))
    b = await run_load(spec(7, False))
    c = await run_load(spec(8, True))
    for res in (a, b, c):
        assert len(res.records) == 25 and res.summary["outcomes"]["ok"] == 25
        _check_consistent(res.records, res.summary)
    # Same seed: same plan (arrival times and lengths), whatever the server's timing was.
    assert [(r.planned, r.prompt_tokens, r.output_tokens) for r in a.records] == \
        [(r.planned, r.prompt_tokens, r.output_tokens) for r in b.records]
    assert [r.planned for r in a.records] != [r.planned for r in c.records]
    assert all(r.ttft is None and not r.token_times for r in b.records)
    assert b.summary["ttft_ms"] == {"count": 0}
    # Saved runs round-trip and the report puts them side by side with PNGs.
    save_run(a, tmp_path / "stream")
    save_run(b, tmp_path / "nostream")
    assert read_records(tmp_path / "stream" / "records.jsonl") == a.records
    md = report([tmp_path / "stream", tmp_path / "nostream"], tmp_path / "rep")
    assert "| metric | stream | nostream |" in md and "| ok | 25 | 25 |" in md
    assert (tmp_path / "rep" / "latency_cdf.png").stat().st_size > 1000


async def test_disconnects_and_hard_timeout(nursery: trio.Nursery) -> None:
    """Planned hang-ups are ``disconnected``; requests the run outlives are ``timeout``; the run
    ends by itself; the server sees every stream closed."""
    app, url = await _server(nursery, token_delay_s=0.003)
    res = await run_load(LoadSpec(base_url=url, tenants=(TenantSpec(concurrency=4,
                                                                    output_len=Lengths(30, 30)),),
                                  duration_s=1.0, disconnect_prob=0.5, seed=3, progress=False,
                                  scrape_interval_s=None))
    _check_consistent(res.records, res.summary)
    dis = [r for r in res.records if r.outcome == "disconnected"]
    assert dis and all(len(r.token_times) < 30 for r in dis)
    assert res.summary["outcomes"]["ok"] > 0
    with trio.fail_after(5):
        while app.inflight:
            await trio.sleep(0.01)

    slow, slow_url = await _server(nursery, token_delay_s=1.0)
    t0 = trio.current_time()
    res = await run_load(LoadSpec(base_url=slow_url, tenants=(TenantSpec(concurrency=3,
                                                                         output_len=Lengths(50, 50)),),
                                  duration_s=0.3, drain_timeout_s=0.4, progress=False,
                                  scrape_interval_s=None))
    assert trio.current_time() - t0 < 1.5
    assert len(res.records) == 3 and res.summary["outcomes"]["timeout"] == 3
    assert all(r.error == "run_hard_timeout" for r in res.records)


async def test_connection_errors_are_failures() -> None:
    # A port nobody listens on: every request fails cleanly, none is lost.
    res = await run_load(LoadSpec(base_url="http://127.0.0.1:9", tenants=(TenantSpec(rate=50),),
                                  num_requests=5, progress=False, scrape_interval_s=None))
    assert [r.outcome for r in res.records] == ["failed"] * 5
    assert res.summary["outcomes"]["failed"] == 5


def test_cli_parsing_errors() -> None:
    ap = build_parser()
    with pytest.raises(ValueError, match="--prompt-len"):
        spec_from_args(ap.parse_args(["--base-url", "http://x:1", "--rate", "1", "--duration", "1",
                                      "--prompt-len", "9:3"]))
    with pytest.raises(ValueError, match="rate or --concurrency"):
        spec_from_args(ap.parse_args(["--base-url", "http://x:1", "--duration", "1"]))
    s = spec_from_args(ap.parse_args(["--base-url", "http://x:1", "--duration", "1",
                                      "--tenant", "a:key=k1,rate=3,output=0.5*8,0.5*64"]))
    t = s.tenants[0]
    assert (t.name, t.api_key, t.rate, t.output_len.lo, t.output_len.hi) == ("a", "k1", 3.0, 8, 64)


@given(st.lists(st.tuples(st.sampled_from(OUTCOMES), st.floats(0, 5), st.floats(0, 5),
                          st.integers(0, 40)), max_size=40))
@settings(max_examples=60)
def test_summary_properties(rows: list[tuple[str, float, float, int]]) -> None:
    recs = []
    for i, (oc, start, dt, n) in enumerate(rows):
        times = sorted(round(dt * k / max(1, n), 6) for k in range(1, n + 1))
        recs.append(Record(index=i, tenant=f"t{i % 3}", outcome=oc, start=start, e2e=dt + 0.001,
                           ttft=times[0] if times else None, token_times=times, output_tokens=n,
                           status=200))
    s = summarize(recs)
    assert sum(s["outcomes"].values()) == len(recs)
    for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        _check_stats(s[k])
    if recs:
        assert math.isclose(sum(t["share"] for t in s["tenants"].values()), 1.0) or \
            all(t["output_tokens_delivered"] == 0 for t in s["tenants"].values())


@given(st.floats(0.2, 4.0), st.integers(0, 2**32))
@settings(max_examples=20)
def test_arrivals_mean_rate(burstiness: float, seed: int) -> None:
    gaps = arrivals(random.Random(seed), 10.0, burstiness)
    xs = [next(gaps) for _ in range(4000)]
    assert abs(sum(xs) / len(xs) - 0.1) < 0.02  # mean gap 1/rate whatever the burstiness


def test_lengths_parse() -> None:
    assert Lengths.parse("5") == Lengths(5, 5)
    assert Lengths.parse("2:9").sample(random.Random(1)) in range(2, 10)
    mix = Lengths.parse("0.9*16,0.1*512")
    xs = [mix.sample(random.Random(i)) for i in range(500)]
    assert set(xs) == {16, 512} and 400 < xs.count(16) < 490
    with pytest.raises(ValueError, match="prompt"):
        Lengths.parse("x", "prompt")



async def test_closed_loop_honours_retry_after(nursery: trio.Nursery) -> None:
    """A refused closed-loop worker waits the server's Retry-After (capped) before its next request,
    as a well-behaved client does; with the cap at 0 it resends at once (a 429 storm)."""
    app, url = await _server(nursery, max_inflight=0)  # refuses everything, Retry-After: 1

    async def sent(cap: float) -> int:
        spec = LoadSpec(base_url=url, tenants=(TenantSpec("c", None, concurrency=2),), duration_s=1.0,
                        progress=False, scrape_interval_s=None, max_retry_after_s=cap)
        res = await run_load(spec)
        assert res.summary["outcomes"]["rejected"] == len(res.records)
        return len(res.records)

    polite = await sent(0.25)
    assert 2 <= polite <= 2 * (1.0 / 0.25 + 2)
    assert await sent(0.0) > 4 * polite


async def test_closed_loop_sends_nothing_after_the_duration_whoever_runs_first() -> None:
    """The flaky ``planned <= 2.0``: a closed-loop worker whose request ended just after the
    duration ran before the task that sets ``stop_sending`` at the deadline and planned one more
    request. The window now ends on the clock: here ``stop_sending`` is never set at all."""
    from bench.loadgen import _Run

    run = _Run(LoadSpec(base_url="http://127.0.0.1:9", duration_s=1.0,
                        tenants=(TenantSpec("c", None, concurrency=1),)))
    run.t0 = trio.current_time() - 1.0001  # the duration is over; stop_sending not yet set

    async def one(p: object, u: float) -> None:
        raise AssertionError(f"planned a request at {p.at:.4f} s, after the 1 s duration")  # type: ignore[attr-defined]

    run.one = one  # type: ignore[method-assign]
    with trio.fail_after(5):
        await run.closed_loop(run.spec.tenants[0], 0, [0])
    assert run.sent == 0


async def test_floor_groups_tokens_per_event(nursery: trio.Nursery) -> None:
    """``tokens_per_event`` (the http-floor floor at calserve's grouping): the same tokens in
    fewer events, every token accounted for (usage and text), the mean group size as asked."""
    app, url = await _server(nursery, tokens_per_event=4.8, chunk_bytes=150)
    spec = LoadSpec(base_url=url, tenants=(TenantSpec(concurrency=2, prompt_len=Lengths(3, 3),
                                                      output_len=Lengths(48, 48)),),
                    num_requests=4, stream=True, progress=False,
                    scrape_interval_s=None)
    res = await run_load(spec)
    assert res.summary["outcomes"]["ok"] == 4
    for r in res.records:
        assert r.output_tokens == 48 and len(r.token_times) == 10  # 48 / 4.8
    assert app.events_sent == 40


@pytest.mark.parametrize("top_p, sent", [(1.0, False), (0.9, True)])
def test_a_sampled_load_sends_top_p_below_one(top_p: float, sent: bool) -> None:
    import json

    from bench.loadgen import _Run
    from bench.workload import PlannedRequest

    spec = LoadSpec(base_url="http://127.0.0.1:1", tenants=(TenantSpec(concurrency=1),),
                    temperature=0.7, top_p=top_p, num_requests=1, progress=False,
                    scrape_interval_s=None)
    body = json.loads(_Run(spec)._body(PlannedRequest(0, "default", 0.0, [1, 2], 2, 4)))
    assert body["temperature"] == 0.7
    assert ("top_p" in body) is sent and body.get("top_p", 1.0) == top_p
