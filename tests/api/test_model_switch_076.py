"""Replacement on calrt-0.7.6 (one resident calbin): the old generation drains first, new requests
wait (WaitingModel) and are served by the new one; only 200s, or 503s with Retry-After. A refusal
after the old generation was unloaded re-publishes its artifact (same sha256, a new generation id)
and is still reported as a 4xx."""

from __future__ import annotations

from typing import Any

import trio

from .model_control_util import (PROMPTS, Packages, control_app, control_config, packages,
                                 stream_text, wait_until)

__all__ = ["packages"]


async def test_replace_under_a_closed_loop_on_calrt_076(packages: Packages) -> None:
    async with control_app(control_config(packages, "calrt-0.7.6")) as h:
        fp_a, solo_a = await h.solo()
        dram_a = h.real.backend.dram()[1]
        results: list[tuple[int, str, str, set[str], bool, Any]] = []
        stop = trio.Event()

        async def client(i: int) -> None:
            k = i
            while not stop.is_set():
                p = PROMPTS[k % len(PROMPTS)]
                k += 1
                status, events = await h.stream(p, 16)
                if status == 200:
                    text, fps, ok = stream_text(events)
                    results.append((status, p, text, fps, ok, None))
                else:
                    results.append((status, p, "", set(), False, events[0]))

        async with trio.open_nursery() as n:
            for i in range(4):
                n.start_soon(client, i)
            await wait_until(lambda: _n(results, 8))
            status, entry = await h.admin("POST", "/models/qwen3/load", {"package": "b"})
            assert status == 200, entry
            k = len(results)
            await wait_until(lambda: _n(results, k + 12))
            stop.set()
        fp_b, solo_b = await h.solo()
        solo = {fp_a: solo_a, fp_b: solo_b}
        statuses = {r[0] for r in results}
        assert statuses <= {200, 503}, statuses
        seen = set()
        for status, p, text, fps, ok, err in results:
            if status == 503:
                assert err["error"]["code"] in ("model_unavailable",), err
                continue
            assert ok and len(fps) == 1, (p, fps)
            (fp,) = fps
            seen.add(fp)
            assert text == solo[fp][p]
        assert seen == {fp_a, fp_b}
        assert h.real.backend.dram()[1] == dram_a  # one model resident, same size


async def test_requests_during_the_switch_wait_for_the_new_generation(packages: Packages) -> None:
    """Sent while the old generation drains: none is refused, all are served by the new one."""
    cfg = control_config(packages, "calrt-0.7.6", timing="fast")
    async with control_app(cfg) as h:
        _, solo_a = await h.solo(8)
        got: list[tuple[str, int, Any]] = []
        answers: list[Any] = []

        async def long_one() -> None:
            await h.stream("x", 600, ignore_eos=True)

        async def load() -> None:
            answers.append(await h.admin("POST", "/models/qwen3/load", {"package": "b"}))

        async def short(p: str) -> None:
            s, body, headers = await h.complete(p, 8)
            got.append((p, s, body))

        async with trio.open_nursery() as n:
            n.start_soon(long_one)  # keeps the old generation draining for a while
            await wait_until(lambda: _active(h, 1))
            n.start_soon(load)
            await wait_until(lambda: _switching(h))
            for p in PROMPTS:
                n.start_soon(short, p)
        (status, entry), = answers
        assert status == 200
        fp_b, solo_b = await h.solo(8)
        assert len(got) == len(PROMPTS) and all(s == 200 for _, s, _ in got), got
        assert {b["system_fingerprint"] for _, _, b in got} == {fp_b}
        assert all(b["choices"][0]["text"] == solo_b[p] for p, _, b in got)
        assert solo_b != solo_a


async def test_refusal_after_the_old_one_was_unloaded_republishes_it(packages: Packages) -> None:
    async with control_app(control_config(packages, "calrt-0.7.6")) as h:
        fp_a, solo_a = await h.solo()
        before = await h.entry()
        assert before is not None
        status, body = await h.admin("POST", "/models/qwen3/load", {"package": "wrong-golden"})
        assert status == 400 and body["error"]["code"] == "golden"
        assert "re-published" in body["error"]["message"]
        after = await h.entry()
        assert after is not None
        assert after["sha256"] == before["sha256"] and after["generation"] != before["generation"]
        assert after["state"] == "Ready"
        fp, solo = await h.solo()
        assert fp != fp_a and fp.endswith(fp_a[-8:]) and solo == solo_a
        # refused before the lock (capacity, files): the old generation was never touched
        for pkg, code in (("huge", "insufficient_capacity"), ("tampered", "integrity")):
            status, body = await h.admin("POST", "/models/qwen3/load", {"package": pkg})
            assert body["error"]["code"] == code
            assert (await h.entry())["generation"] == after["generation"]  # type: ignore[index]
        # a second alias cannot co-reside on this runtime: it is registered, loaded on demand
        dram = h.real.backend.dram()[1]
        status, body = await h.admin("POST", "/models/other/load", {"package": "b"})
        assert status == 200 and body["state"] == "Unloaded" and body["resident"] is False
        assert h.real.backend.dram()[1] == dram  # it holds no device memory


async def _n(results: list[Any], n: int) -> bool:
    return len(results) >= n


async def _active(h: Any, n: int) -> bool:
    e = await h.entry()
    return e is not None and sum(g["active_requests"] for g in e["generations"]) >= n


async def _switching(h: Any) -> bool:
    return bool(h.real.control.switching)


async def test_waiting_budget_bounds_the_requests_waiting_for_a_switch(packages: Packages) -> None:
    cfg = control_config(packages, "calrt-0.7.6", timing="fast",
                         scheduler={"admission": {"max_waiting_requests": 2}})
    async with control_app(cfg) as h:
        got: list[tuple[int, Any, Any]] = []

        async def long_one() -> None:
            await h.stream("x", 600, ignore_eos=True)

        async def short(p: str) -> None:
            got.append(await h.complete(p, 8))

        async with trio.open_nursery() as n:
            n.start_soon(long_one)
            await wait_until(lambda: _active(h, 1))
            n.start_soon(h.admin, "POST", "/models/qwen3/load", {"package": "b"})
            await wait_until(lambda: _switching(h))
            for p in PROMPTS:
                n.start_soon(short, p)
        statuses = sorted(s for s, _, _ in got)
        assert statuses == [200, 200, 503, 503, 503], statuses
        for s, body, headers in got:
            if s == 503:
                assert "Retry-After" in headers and "too many" in body["error"]["message"]
