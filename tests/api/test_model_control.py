"""The model control plane through the HTTP app on the real engine + software CalRT (sim-next:
co-resident, blue/green): hot replace under a closed loop of streams with zero failures and every
text equal to the solo output of the generation its system_fingerprint names; rollback; refusals
(tampered, outside the root, wrong golden, capacity, busy) leave the old generation serving."""

from __future__ import annotations

from typing import Any

import trio

from .real_engine import parse_metrics, value
from .model_control_util import (PROMPTS, Packages, control_app, control_config, packages,
                                 stream_text, wait_until)

__all__ = ["packages"]  # the session fixture, imported for pytest


async def test_list_shape_and_auth(packages: Packages) -> None:
    async with control_app(control_config(packages)) as h:
        r = await h.client.get("/admin/v1/models")
        assert r.status_code == 401
        r = await h.client.post("/admin/v1/models/qwen3/unload", headers={"Authorization": "Bearer x"})
        assert r.status_code == 401
        status, body = await h.admin("GET", "/models")
        assert status == 200
        (e,) = body["models"]
        assert set(e) >= {"alias", "generation", "state", "package", "sha256", "previous",
                          "generations"}
        assert e["alias"] == "qwen3" and e["state"] == "Ready" and e["previous"] is None
        assert e["package"] == "a" and len(e["sha256"]) == 64
        (g,) = e["generations"]
        assert set(g) >= {"id", "state", "active_requests", "inflight_jobs", "loaded_at"}
        assert g["id"] == e["generation"] and g["state"] == "Ready"
        status, body, _ = await h.complete("hi", 4)
        assert body["system_fingerprint"] == f"calserve-g{e['generation']}-{e['sha256'][:8]}"
        # bad bodies name the field; unknown alias is 404
        status, body = await h.admin("POST", "/models/qwen3/load", {"pkg": "b"})
        assert status == 400
        status, body = await h.admin("POST", "/models/nope/unload", {})
        assert status == 404
        status, body = await h.admin("POST", "/models/qwen3/rollback")
        assert status == 409 and body["error"]["code"] == "no_previous"


async def test_hot_replace_under_closed_loop_then_rollback(packages: Packages) -> None:
    async with control_app(control_config(packages)) as h:
        fp_a, solo_a = await h.solo()
        results: list[tuple[int, str, str, set[str], bool]] = []
        stop = trio.Event()

        async def client(i: int) -> None:
            k = i
            while not stop.is_set():
                p = PROMPTS[k % len(PROMPTS)]
                k += 1
                status, events = await h.stream(p, 16)
                text, fps, ok = stream_text(events) if status == 200 else ("", set(), False)
                results.append((status, p, text, fps, ok))

        dram0 = h.real.backend.dram()[1]
        async with trio.open_nursery() as n:
            for i in range(6):
                n.start_soon(client, i)
            await wait_until(lambda: _true_after(results, 10))
            status, entry = await h.admin("POST", "/models/qwen3/load",
                                          {"package": "b", "drain_timeout_s": 30})
            assert status == 200, entry
            assert entry["state"] == "Ready" and entry["package"] == "b"
            assert entry["previous"] is not None
            n_at_flip = len(results)
            await wait_until(lambda: _true_after(results, n_at_flip + 20))
            stop.set()
        fp_b, solo_b = await h.solo()
        assert fp_b != fp_a and solo_b != solo_a  # really another model
        solo = {fp_a: solo_a, fp_b: solo_b}
        seen = set()
        for status, p, text, fps, ok in results:
            assert status == 200 and ok, (status, p)
            assert len(fps) == 1, fps  # every chunk names one generation: pinned for life
            (fp,) = fps
            seen.add(fp)
            assert text == solo[fp][p], (fp, p)
        assert seen == {fp_a, fp_b}
        # the old generation drained and unloaded by itself; its DRAM is back
        async def old_gone() -> bool:
            e = await h.entry()
            return e is not None and len(e["generations"]) == 1
        await wait_until(old_gone)
        assert h.real.backend.dram()[1] == dram0
        # nothing of the unloaded generation is left in the core (queues, profiles, share)
        assert len(h.real.core.requests.all_queues()) <= len(h.real.model_manager.generations)

        # rollback: the old artifact re-verified, a new generation with the old sha256 and output
        status, entry = await h.admin("POST", "/models/qwen3/rollback", {})
        assert status == 200, entry
        assert entry["package"] == "a" and fp_a.endswith(entry["sha256"][:8])
        fp_r, solo_r = await h.solo()
        assert fp_r != fp_a and fp_r.endswith(fp_a[-8:]) and solo_r == solo_a
        await wait_until(old_gone)
        m = parse_metrics((await (await h.client.get("/metrics")).get_data()).decode())
        assert value(m, "calserve_model_switches_total", alias="qwen3") == 2
        assert value(m, "calserve_model_operations_total", op="load", result="ok") == 1
        assert value(m, "calserve_model_operations_total", op="rollback", result="ok") == 1
        for phase in ("load", "configure", "warmup", "drain", "unload"):
            assert value(m, "calserve_model_phase_seconds_count", phase=phase) == 2, phase
        assert value(m, "calserve_device_dram_used_bytes") == dram0 == h.real.backend.dram()[1]
        assert value(m, "calserve_model_generations", state="Ready") == 1
        assert value(m, "calserve_model_generation", alias="qwen3") == (await h.entry())["generation"]  # type: ignore[index]


async def _true_after(results: list[Any], n: int) -> bool:
    return len(results) >= n


async def test_refusals_leave_the_old_generation_serving(packages: Packages) -> None:
    async with control_app(control_config(packages)) as h:
        fp_a, solo_a = await h.solo()
        before = await h.entry()
        cases = [
            ("tampered", 400, "integrity"),
            ("../outside", 400, "package_path"),
            ("/etc", 400, "package_path"),
            ("wrong-golden", 400, "golden"),
            ("huge", 409, "insufficient_capacity"),
            ("missing", 400, "package_path"),
        ]
        for pkg, code, step in cases:
            status, body = await h.admin("POST", "/models/qwen3/load", {"package": pkg})
            assert status == code and body["error"]["code"] == step, (pkg, body)
            assert body["error"]["param"] == "package"
            fp, solo = await h.solo()
            assert fp == fp_a and solo == solo_a, pkg
        after = await h.entry()
        assert after is not None and before is not None
        assert after["generation"] == before["generation"] and len(after["generations"]) == 1
        assert after["previous"] is None  # nothing was published


async def test_second_operation_on_the_alias_is_409(packages: Packages) -> None:
    async with control_app(control_config(packages)) as h:
        answers: list[tuple[int, Any]] = []

        async def load() -> None:
            answers.append(await h.admin("POST", "/models/qwen3/load", {"package": "b"}))

        async with trio.open_nursery() as n:
            n.start_soon(load)
            await wait_until(lambda: _locked(h))
            answers.append(await h.admin("POST", "/models/qwen3/unload", {}))
        codes = sorted(s for s, _ in answers)
        assert codes == [200, 409], answers
        busy = next(b for s, b in answers if s == 409)
        assert busy["error"]["code"] == "lifecycle_busy"


async def _locked(h: Any) -> bool:
    return bool(h.real.control.lock_of("qwen3").locked())
