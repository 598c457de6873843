"""``calserve models list|load|unload|rollback`` against a real ``hypercorn -k trio calserve:app``
process (software runtime, sim-next): a new alias, a hot replacement, a rollback, an unload, a
refusal, and a wrong token."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import trio

from calserve.cli import main
from calserve.models.demo import pack_demo_variant
from calserve.models.signing import dev_key

from .server import serving

TOKEN = "cli-secret"


def test_models_cli_against_a_real_server(new_demo_home: Callable[[str], Path],
                                          tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    home = new_demo_home("cli-home")
    root = tmp_path / "models"
    root.mkdir()
    shutil.copytree(home / "models" / "demo-qwen3", root / "a")
    pack_demo_variant(root / "b", dev_key(home), seed=11)
    cfg = (f"runtime: {{profile: sim-next}}\nscheduler: {{batch: {{profiles: [1, 4]}}}}\n"
           f"trust: {{model_root: {root}}}\nadmin: {{token: {TOKEN}}}\n"
           "models: {m: {package: a}}\n")  # no scheduler.model_alias: the first key is the default
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    with serving(home, cwd, cfg) as proc:
        url = proc.url

        def cli(*args: str, token: str = TOKEN) -> tuple[int, str, str]:
            rc = main(["models", *args, "--url", url, "--token", token])
            out = capsys.readouterr()
            return rc, out.out, out.err

        def text(model: str | None = None) -> tuple[str, str]:
            body = {"prompt": "Once upon", "max_tokens": 12, "temperature": 0}
            if model:
                body["model"] = model
            r = httpx.post(url + "/v1/completions", json=body, timeout=30).json()
            return r["system_fingerprint"], r["choices"][0]["text"]

        fp_a, text_a = text()  # the default alias (m) without `model`
        rc, out, _ = cli("list")
        assert rc == 0 and "m " in out and "Ready" in out
        rc, out, _ = cli("load", "other", "b")
        assert rc == 0 and '"alias": "other"' in out
        assert text("other")[1] != text_a
        rc, out, _ = cli("load", "m", "b", "--drain-timeout", "5")
        assert rc == 0
        fp_b, text_b = text()
        assert fp_b != fp_a and text_b == text("other")[1]
        rc, out, _ = cli("rollback", "m")
        assert rc == 0
        fp_r, text_r = text()
        assert text_r == text_a and fp_r.endswith(fp_a[-8:])
        rc, _, err = cli("load", "m", "../../etc")
        assert rc == 1 and "400 package_path" in err
        rc, _, err = cli("list", token="wrong")
        assert rc == 1 and "401 invalid_admin_token" in err
        rc, out, _ = cli("unload", "other")
        assert rc == 0 and '"state": "Unloaded"' in out
        r = httpx.post(url + "/v1/completions", json={"model": "other", "prompt": "x"}, timeout=30)
        assert r.status_code == 404
        rc, out, _ = cli("list", "--json")
        assert rc == 0 and '"other"' not in out


async def test_hot_replace_under_streaming_load_on_a_real_server(
        new_demo_home: Callable[[str], Path], tmp_path: Path) -> None:
    """Blue/green on sim-next through a real process: 6 closed-loop streaming clients while the
    alias is replaced: every stream is a 200 that ends with [DONE], names one generation in every
    chunk, and its text equals the solo output of that generation."""
    home = new_demo_home("replace-home")
    root = tmp_path / "models"
    root.mkdir()
    shutil.copytree(home / "models" / "demo-qwen3", root / "a")
    pack_demo_variant(root / "b", dev_key(home), seed=11)
    cfg = (f"runtime: {{profile: sim-next}}\nscheduler: {{batch: {{profiles: [1, 4]}}, "
           f"executor: {{max_inflight: 2}}}}\ntrust: {{model_root: {root}}}\n"
           f"admin: {{token: {TOKEN}}}\nmodels: {{m: {{package: a, timing: fast}}}}\n")
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    body = {"prompt": "Once upon", "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    with serving(home, cwd, cfg) as proc:
        url = proc.url
        results: list[tuple[int, set[str], str, bool]] = []

        async with httpx.AsyncClient(timeout=60) as client:
            async def solo() -> tuple[str, str]:
                r = (await client.post(url + "/v1/completions", json=body)).json()
                return r["system_fingerprint"], r["choices"][0]["text"]

            async def stream_once() -> None:
                fps: set[str] = set()
                text, done = "", False
                async with client.stream("POST", url + "/v1/completions",
                                         json={**body, "stream": True}) as r:
                    async for line in r.aiter_lines():
                        if not line.startswith("data: "):
                            continue
                        if line == "data: [DONE]":
                            done = True
                            continue
                        ev = json.loads(line[6:])
                        fps.add(ev.get("system_fingerprint", "?"))
                        text += ev["choices"][0]["text"] if ev.get("choices") else ""
                    results.append((r.status_code, fps, text, done))

            fp_a, solo_a = await solo()
            stop = trio.Event()

            async def loop() -> None:
                while not stop.is_set():
                    await stream_once()

            async with trio.open_nursery() as n:
                for _ in range(6):
                    n.start_soon(loop)
                while len(results) < 12:
                    await trio.sleep(0.05)
                r = await client.post(url + "/admin/v1/models/m/load",
                                      headers={"Authorization": f"Bearer {TOKEN}"},
                                      json={"package": "b", "drain_timeout_s": 30})
                assert r.status_code == 200, r.text
                flipped = len(results)
                while len(results) < flipped + 24:
                    await trio.sleep(0.05)
                stop.set()
            fp_b, solo_b = await solo()
    assert fp_a != fp_b and solo_a != solo_b
    solo = {fp_a: solo_a, fp_b: solo_b}
    seen = set()
    for status, fps, text, done in results:
        assert status == 200 and done, (status, fps)
        assert len(fps) == 1, fps  # pinned to one generation for life
        (fp,) = fps
        assert text == solo[fp], (fp, text)
        seen.add(fp)
    assert seen == {fp_a, fp_b}  # both generations served during the run
