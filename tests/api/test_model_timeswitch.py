"""calrt-0.7.6 with two aliases (spec §13 time-switching): one resident at a time, the other listed
``Unloaded`` / ``resident: false`` with no device memory; a request for it waits and switches it in;
a mixed closed loop on both aliases loses no request and switches a bounded number of times
(minimum residency)."""

from __future__ import annotations

from typing import Any

import trio

from .model_control_util import PROMPTS, Packages, control_app, control_config, packages

__all__ = ["packages"]

MIN_RES = 0.4


def switch_config(pk: Packages) -> Any:
    return control_config(pk, "calrt-0.7.6", models={"m1": {"package": "a", "timing": "fast"},
                                                     "m2": {"package": "b", "timing": "fast"}},
                          switching={"min_residency_s": MIN_RES, "drain_timeout_s": 30})


def _model_info_is_the_listed_entry(engine: Any) -> None:
    """What a request resolves its model with (``Engine.model_info``, that entry alone) is what
    ``/v1/models`` lists for it, resident or not; None for an alias not served."""
    listed = engine.models()
    for alias in ("m1", "m2", "nope"):
        assert engine.model_info(alias) == next((i for i in listed if i.alias == alias), None)


async def test_non_resident_alias_is_listed_and_switched_in_on_demand(packages: Packages) -> None:
    async with control_app(switch_config(packages)) as h:
        e1, e2 = await h.entry("m1"), await h.entry("m2")
        assert e1 is not None and e1["state"] == "Ready" and e1["resident"] is True
        assert e2 is not None and e2["state"] == "Unloaded" and e2["resident"] is False
        assert e2["generations"] == [] and e2["package"] == "b"
        _model_info_is_the_listed_entry(h.real)
        dram_one = h.real.backend.dram()[1]
        r = await h.client.get("/ready")
        assert r.status_code == 200
        r = await h.client.get("/ready?model=m2")
        assert r.status_code == 200  # loadable on demand
        s, body, _ = await h.complete("hello", 8, model="m2")
        assert s == 200, body
        e1, e2 = await h.entry("m1"), await h.entry("m2")
        assert e2["state"] == "Ready" and e2["resident"] is True  # type: ignore[index]
        assert e1["state"] == "Unloaded" and e1["resident"] is False  # type: ignore[index]
        assert body["system_fingerprint"] == e2["generations"][0]["system_fingerprint"]  # type: ignore[index]
        assert h.real.backend.dram()[1] == dram_one  # one resident at a time
        _model_info_is_the_listed_entry(h.real)


async def test_mixed_load_on_both_aliases_loses_nothing_and_switches_boundedly(
        packages: Packages) -> None:
    async with control_app(switch_config(packages)) as h:
        solo: dict[str, dict[str, str]] = {}
        for alias in ("m1", "m2"):
            _, solo[alias] = await h.solo(12, alias)
        assert solo["m1"] != solo["m2"]
        sw0 = h.real.control.switcher.switches_total
        results: list[tuple[str, str, int, Any]] = []
        stop = trio.Event()

        async def client(alias: str, i: int) -> None:
            k = i
            while not stop.is_set():
                p = PROMPTS[k % len(PROMPTS)]
                k += 1
                s, body, _ = await h.complete(p, 12, alias)
                results.append((alias, p, s, body))

        t0 = trio.current_time()
        async with trio.open_nursery() as n:
            for i in range(3):
                n.start_soon(client, "m1", i)
                n.start_soon(client, "m2", i)
            await trio.sleep(3.0)
            stop.set()
        wall = trio.current_time() - t0
        switches = h.real.control.switcher.switches_total - sw0
        assert all(s == 200 for _, _, s, _ in results), [b for _, _, s, b in results if s != 200]
        for alias, p, _, body in results:
            assert body["choices"][0]["text"] == solo[alias][p]
        served = {a for a, _, _, _ in results}
        assert served == {"m1", "m2"}
        # bounded: at most one switch per minimum residency (+ the last one in flight)
        assert 2 <= switches <= wall / MIN_RES + 2, (switches, wall)
