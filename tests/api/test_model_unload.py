"""Unload (spec §12) through the HTTP app on the real engine + software CalRT: requests in flight and
a drain deadline; a deadline that passes while a job is still on the device (Recovering, nothing
freed early); device DRAM back to where it was; the alias is unknown afterwards."""

from __future__ import annotations

from typing import Any

import msgspec
import trio

from .model_control_util import (Packages, control_app, control_config, packages, stream_text,
                                 wait_until)

__all__ = ["packages"]


async def test_unload_with_requests_in_flight_and_a_drain_deadline(packages: Packages) -> None:
    cfg = control_config(packages, timing="fast",
                         scheduler={"admission": {"max_sequences": 2}})
    async with control_app(cfg) as h:
        dram_before_second = h.real.backend.dram()[1]
        status, e = await h.admin("POST", "/models/other/load", {"package": "b"})
        assert status == 200 and e["state"] == "Ready"
        loaded = h.real.backend.dram()[1]
        assert loaded > dram_before_second
        streams: list[tuple[int, list[Any]]] = []
        short: list[tuple[int, Any]] = []

        async def long_stream() -> None:
            streams.append(await h.stream("x " * 10, 1800, model="other", ignore_eos=True))

        async def short_one() -> None:
            s, b, _ = await h.complete("hello", 8, model="other")
            short.append((s, b))

        unload: list[tuple[int, Any]] = []
        async with trio.open_nursery() as n:
            for _ in range(2):  # the two lanes, decoding
                n.start_soon(long_stream)
            await wait_until(lambda: _active(h, "other", 2))
            for _ in range(2):  # queued behind them (no free lane)
                n.start_soon(short_one)
            await wait_until(lambda: _active(h, "other", 4))
            t0 = trio.current_time()

            async def do_unload() -> None:
                # 0.2 s: the two 1,800-token streams (package b: no modelled timing, so they run at
                # the CPU's speed) must still be running when it passes; they took ~0.45 s here
                unload.append(await h.admin("POST", "/models/other/unload",
                                            {"drain_timeout_s": 0.2}))

            n.start_soon(do_unload)
            await wait_until(lambda: _state(h, "other", "Draining"))
            s, body, headers = await h.complete("new", 4, model="other")  # draining: 503
            assert s == 503 and "Retry-After" in headers, body
        took = trio.current_time() - t0
        (status, body), = unload
        assert status == 200 and body["state"] == "Unloaded", body
        assert body["dram_freed_bytes"] == loaded - dram_before_second
        assert 0.2 <= took < 10
        # waiting requests ended at once with a clear error; running ones were cut at the deadline
        assert [s for s, _ in short] == [503, 503]
        assert all("unload" in b["error"]["message"] for _, b in short)
        for s, events in streams:
            assert s == 200
            text, _, ok = stream_text(events)
            assert not ok and "error" in events[-1] and text  # partial output, then the error
        assert h.real.backend.dram()[1] == dram_before_second
        s, body, _ = await h.complete("after", 4, model="other")
        assert s == 404
        assert await h.entry("other") is None
        s, body, _ = await h.complete("still", 4)  # the other alias was never touched
        assert s == 200


async def test_drain_deadline_with_a_job_on_the_device_goes_recovering(packages: Packages) -> None:
    """A 1,500-token prefill takes ~0.56 s of modelled device time (qwen3-dual): the 50 ms drain
    deadline passes with it on the device. The generation goes Recovering, keeps its DRAM until the
    job came back, then unloads."""
    cfg = control_config(packages, timing="qwen3-dual",
                         scheduler={"batch": {"profiles": [1]}})  # one member: a short golden
    async with control_app(cfg) as h:
        dram_loaded = h.real.backend.dram()[1]
        gid = (await h.entry())["generation"]  # type: ignore[index]
        seen: list[tuple[str, int]] = []
        results: list[Any] = []

        async def long_prefill() -> None:
            results.append(await h.stream("a " * 1500, 4))

        unload: list[tuple[int, Any]] = []
        async with trio.open_nursery() as n:
            n.start_soon(long_prefill)
            await wait_until(lambda: _jobs(h, gid, 1))

            async def do_unload() -> None:
                unload.append(await h.admin("POST", "/models/qwen3/unload",
                                            {"drain_timeout_s": 0.05}))

            n.start_soon(do_unload)
            gen = h.real.model_manager.generations[gid]
            while not unload:
                seen.append((gen.state.value, h.real.backend.dram()[1]))
                await trio.sleep(0.005)
        states = [s for s, _ in seen]
        assert "Recovering" in states, states
        # nothing was freed while the job was on the device
        assert all(d == dram_loaded for s, d in seen if s in ("Draining", "Recovering"))
        (status, body), = unload
        assert status == 200 and body["state"] == "Unloaded"
        assert h.real.backend.dram()[1] == 0
        (s, events), = results
        assert s == 200 and "error" in events[-1]  # cut at the deadline, after its job drained


async def _active(h: Any, alias: str, n: int) -> bool:
    e = await h.entry(alias)
    return e is not None and sum(g["active_requests"] for g in e["generations"]) >= n


async def _state(h: Any, alias: str, state: str) -> bool:
    e = await h.entry(alias)
    return e is not None and e["state"] == state


async def _jobs(h: Any, gid: int, n: int) -> bool:
    e = await h.entry()
    return e is not None and any(g["id"] == gid and g["inflight_jobs"] >= n
                                 for g in e["generations"])


async def test_ready_stays_200_while_another_alias_serves_after_the_default_is_unloaded(
        packages: Packages) -> None:
    async with control_app(control_config(packages, timing="fast")) as h:
        status, _ = await h.admin("POST", "/models/other/load", {"package": "b"})
        assert status == 200
        status, body = await h.admin("POST", "/models/qwen3/unload", {"drain_timeout_s": 1})
        assert status == 200 and body["state"] == "Unloaded"
        r = await h.client.get("/ready")  # no model: ready while any alias can be served
        assert r.status_code == 200
        assert msgspec.json.decode(await r.get_data())["model"] == "other"
        r = await h.client.get("/ready?model=qwen3")  # the unloaded alias itself: unknown
        assert r.status_code == 404
        s, _, _ = await h.complete("still", 4, model="other")
        assert s == 200
