"""Packages and an in-process server on the REAL engine + software CalRT for the model control
plane's tests (issue 14): a trusted model root holding the demo package (``a``), the demo
architecture with other weights (``b``), a tampered copy, a copy with a wrong golden and a copy
whose capacity does not fit; the app started with ``Engine.open`` (software runtime, real time)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
import trio

from calserve.api.app import create_app, get_state
from calserve.engine.engine import Engine
from calserve.models.demo import pack_demo_variant
from calserve.models.signing import dev_key, sign_package

from .conftest import Harness, engine_opened, make_config
from .sse_util import parse_sse, stream_post

TOKEN = "admin-secret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
PROMPTS = ["Once upon a time", "The river", "Hello world, this is", "A B C", "numbers 1 2 3"]


@dataclasses.dataclass(frozen=True)
class Packages:
    root: Path
    pub: Path


def _edit(pkg: Path, key: Path, name: str, fn: Callable[[dict[str, Any]], None]) -> None:
    p = pkg / name
    m = json.loads(p.read_text())
    fn(m)
    p.write_text(json.dumps(m, indent=2))
    sign_package(pkg, key)


@pytest.fixture(scope="session")
def packages(new_demo_home: Callable[[str], Path],
             tmp_path_factory: pytest.TempPathFactory) -> Packages:
    home = new_demo_home("mc-home")
    key = dev_key(home)
    root = tmp_path_factory.mktemp("mc-root")
    shutil.copytree(home / "models" / "demo-qwen3", root / "a")
    pack_demo_variant(root / "b", key, seed=7)
    shutil.copytree(root / "a", root / "tampered")
    w = root / "tampered" / "model.safetensors"
    raw = bytearray(w.read_bytes())
    raw[-1] ^= 0xFF
    w.write_bytes(bytes(raw))
    shutil.copytree(root / "b", root / "wrong-golden")

    def bad_golden(g: dict[str, Any]) -> None:
        for case in g["cases"]:
            for b, toks in case["expected"].items():
                case["expected"][b] = [(t + 1) % 100 for t in toks]

    _edit(root / "wrong-golden", key, "golden.json", bad_golden)
    shutil.copytree(root / "b", root / "huge")

    def huge(m: dict[str, Any]) -> None:
        res = m["capacity"]["dram_reservation_bytes"]
        for b in res:
            res[b] = 1 << 40

    _edit(root / "huge", key, "manifest.json", huge)
    (tmp_path_factory.mktemp("outside") / "pkg").mkdir()
    return Packages(root, key.with_name(key.name + ".pub"))


def control_config(pk: Packages, profile: str = "sim-next", *, timing: str | None = None,
                   models: dict[str, Any] | None = None, **sections: Any) -> Any:
    sched = sections.pop("scheduler", {})
    if profile == "sim-next":
        sched.setdefault("batch", {"profiles": [1, 4, 8, 16]})
        sched.setdefault("executor", {"max_inflight": 2})
    return make_config(
        runtime={"profile": profile, **sections.pop("runtime", {})},
        scheduler=sched,
        trust={"model_root": str(pk.root), "trusted_keys": [str(pk.pub)], "trust_dev_key": False},
        models=models or {"qwen3": {"package": "a", "timing": timing}},
        admin={"token": TOKEN}, **sections)


class ControlHarness(Harness):
    @property
    def real(self) -> Engine:
        host = get_state(self.app).host
        assert host is not None and isinstance(host.engine, Engine)
        return host.engine

    async def admin(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        if method == "GET":
            r = await self.client.get(f"/admin/v1{path}", headers=AUTH)
        else:
            r = await self.client.post(f"/admin/v1{path}", headers=AUTH,
                                       data=msgspec.json.encode(body) if body is not None else b"")
        return r.status_code, msgspec.json.decode(await r.get_data())

    async def entry(self, alias: str = "qwen3") -> dict[str, Any] | None:
        _, body = await self.admin("GET", "/models")
        return next((e for e in body["models"] if e["alias"] == alias), None)

    async def complete(self, prompt: str, n: int = 16, model: str = "qwen3",
                       **extra: Any) -> tuple[int, Any, Any]:
        return await self.post("/v1/completions", {"model": model, "prompt": prompt,
                                                   "max_tokens": n, "temperature": 0, **extra})

    async def stream(self, prompt: str, n: int = 16, model: str = "qwen3",
                     **extra: Any) -> tuple[int, list[Any]]:
        status, raw = await stream_post(self.client, "/v1/completions", {
            "model": model, "prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True,
            **extra})
        return status, parse_sse(raw) if status == 200 else [msgspec.json.decode(raw)]

    async def solo(self, n: int = 16, model: str = "qwen3") -> tuple[str, dict[str, str]]:
        """The fingerprint now serving ``model`` and each prompt's greedy text, one at a time."""
        out: dict[str, str] = {}
        fp = ""
        for p in PROMPTS:
            status, body, _ = await self.complete(p, n, model)
            assert status == 200, body
            out[p] = body["choices"][0]["text"]
            fp = body["system_fingerprint"]
        return fp, out


def stream_text(events: list[Any]) -> tuple[str, set[str], bool]:
    """(text, fingerprints seen, ended with [DONE] and no error event)."""
    text = "".join(e["choices"][0]["text"] for e in events
                   if isinstance(e, dict) and e.get("choices"))
    fps = {e["system_fingerprint"] for e in events if isinstance(e, dict) and "system_fingerprint" in e}
    ok = bool(events) and events[-1] == "[DONE]" and not any(
        isinstance(e, dict) and "error" in e for e in events)
    return text, fps, ok


@contextlib.asynccontextmanager
async def control_app(config: Any) -> AsyncIterator[ControlHarness]:
    app = create_app(config, engine_factory=lambda cfg: Engine.open(cfg))
    async with app.test_app() as t:
        await engine_opened(app)  # the app listens first; the model loads behind it
        yield ControlHarness(app, t.test_client())


async def wait_until(pred: Callable[[], Any], timeout: float = 30.0) -> None:
    with trio.fail_after(timeout):
        while not await pred():
            await trio.sleep(0.02)
