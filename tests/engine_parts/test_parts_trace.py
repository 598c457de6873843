"""The timed trace ring and its Chrome trace export: bounded, job spans from the runtime's run time,
request phases as async spans, and the PING/PONG overlap fraction."""

from __future__ import annotations

import pytest

from calserve.engine.trace import Timeline, chrome_trace, overlap_fraction


def test_ring_is_bounded_and_can_be_off() -> None:
    t = Timeline(3)
    for i in range(5):
        t.request(float(i), "queued", i)
    assert [e[3] for e in t.snapshot()] == [2, 3, 4]
    off = Timeline(0)
    off.job("PING", "decode", 16, 3, 1, 0.0, 1.0, 0.5, "ok")
    assert off.snapshot() == []


def test_export_and_overlap() -> None:
    t = Timeline(100)
    # PING runs [0, 10] ms (submitted at 0), PONG runs [5, 15] ms (submitted at 2, waited 3 ms)
    t.job("PING", "decode", 16, 16, 1, 0.000, 0.010, 0.010, "ok")
    t.job("PONG", "decode", 8, 5, 2, 0.002, 0.015, 0.010, "crosstalk")
    t.request(0.0, "queued", 7)
    t.request(0.001, "admitted", 7)
    t.request(0.004, "first_token", 7)
    t.request(0.006, "lost", 7)
    t.request(0.012, "end", 7)
    doc = chrome_trace(t.snapshot())
    jobs = {e["args"]["engine"]: e for e in doc["traceEvents"] if e["ph"] == "X"}
    assert jobs["PONG"]["ts"] == pytest.approx(5000.0) and jobs["PONG"]["dur"] == pytest.approx(10000.0)
    assert jobs["PONG"]["args"]["queue_us"] == pytest.approx(3000.0)
    assert jobs["PONG"]["args"]["status"] == "crosstalk" and jobs["PONG"]["name"] == "decode B8"
    spans = [(e["name"], e["ph"], e["ts"]) for e in doc["traceEvents"] if e["ph"] in "be"]
    assert [s[:2] for s in spans] == [("queued", "b"), ("queued", "e"), ("prefill", "b"),
                                      ("prefill", "e"), ("decode", "b"), ("decode", "e")]
    assert any(e["ph"] == "n" and e["name"] == "lost" for e in doc["traceEvents"])
    ov = overlap_fraction(doc)
    # both ran [5, 10] ms of [0, 15] ms busy
    assert ov["overlap"] == pytest.approx(5 / 15) and ov["busy_s"] == pytest.approx(0.015)
    assert ov["ping_busy_s"] == pytest.approx(0.010)


def test_overlap_of_one_engine_or_nothing_is_zero() -> None:
    t = Timeline(10)
    t.job("PING", "decode", 1, 1, 1, 0.0, 0.01, 0.01, "ok")
    t.job("PING", "decode", 1, 1, 2, 0.01, 0.02, 0.01, "ok")
    assert overlap_fraction(chrome_trace(t.snapshot()))["overlap"] == 0.0
    assert overlap_fraction(chrome_trace([]))["overlap"] == 0.0
