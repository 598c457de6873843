"""``calserve cluster``: 2 replicas behind the real HAProxy on 127.0.0.1, streaming load through it.

Shown, in order, on one cluster: both replicas serve (per-replica counters from their own
/metrics); ``kill -9`` of one under load ends only the streams it was serving (error event or
closed connection, never a hang) while the other's complete; requests sent after the health check
noticed all succeed on the other; the supervisor restarts the killed one (new pid in
replicas.json) and HAProxy puts it back into rotation; ``SIGTERM`` to the cluster drains: every
admitted stream completes with ``[DONE]`` and every process exits 0.

HAProxy is required (``.ci/run`` installs Debian's ``haproxy``): without it this test fails.
"""

from __future__ import annotations

import csv
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from .server import scrape, server_env, total

pytestmark = pytest.mark.timeout(240)

_CONFIG = """
scheduler:
  batch: {profiles: [16], instance_pool: 16, batching_window_us: 500}
  executor: {max_inflight: 2}
  admission: {max_waiting_requests: 256}
runtime: {profile: sim-next}
server: {drain_timeout_s: 30}
models:
  qwen3: {package: null, timing: qwen3-dual}
"""
_CHECK_MS = 300


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Cluster:
    def __init__(self, home: Path, tmp: Path) -> None:
        assert shutil.which("haproxy"), "haproxy is required: apt-get install haproxy"
        cfg = tmp / "calserve.yaml"
        cfg.write_text(_CONFIG)
        self.run_dir = tmp / "run"
        self.port, self.stats = _free_port(), _free_port()
        self.log = open(tmp / "cluster.log", "w+")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "calserve.cli", "cluster", "--replicas", "2", "--config",
             str(cfg), "--port", str(self.port), "--stats-port", str(self.stats), "--run-dir",
             str(self.run_dir), "--check-interval-ms", str(_CHECK_MS)],
            env=server_env(home), cwd=tmp, stdout=self.log, stderr=subprocess.STDOUT,
            start_new_session=True)
        self.url = f"http://127.0.0.1:{self.port}"

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        text = self.log.read()
        for f in sorted(self.run_dir.glob("*.log")):
            text += f"\n--- {f.name}\n" + f.read_text()[-3000:]
        return text

    def replicas(self) -> list[dict[str, Any]]:
        return list(json.loads((self.run_dir / "replicas.json").read_text()))

    def status(self) -> dict[str, str]:
        """HAProxy's view: server name -> UP/DOWN/... (stats page CSV)."""
        text = httpx.get(f"http://127.0.0.1:{self.stats}/;csv", timeout=5).text.lstrip("# ")
        return {row["svname"]: row["status"] for row in csv.DictReader(io.StringIO(text))
                if row["svname"] not in ("FRONTEND", "BACKEND")}

    def wait_status(self, want: dict[str, str], timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        last: dict[str, str] = {}
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.output()
            try:
                last = self.status()
                if all(last.get(k, "").startswith(v) for k, v in want.items()):
                    return
            except (httpx.HTTPError, OSError):
                pass
            time.sleep(0.1)
        raise AssertionError(f"HAProxy status {last}, wanted {want}\n{self.output()}")

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        for r in self.replicas() if (self.run_dir / "replicas.json").exists() else []:
            try:
                os.kill(r["pid"], signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.log.close()


async def _stream(client: httpx.AsyncClient, url: str, max_tokens: int, out: dict[str, Any],
                  got_token: trio.Event | None = None) -> None:
    body = {"model": "qwen3", "prompt": "cluster", "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True, "temperature": 0}
    out.update(status=None, done=False, error=None, tokens=0, closed=None, server=None)
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            out["status"] = r.status_code
            out["server"] = r.headers.get("x-calserve-server")
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    out["done"] = True
                    continue
                ev = json.loads(line[6:])
                if "error" in ev:
                    out["error"] = ev["error"]
                    continue
                out["tokens"] += 1
                if got_token is not None and out["tokens"] == 1:
                    got_token.set()
    except (httpx.HTTPError, httpx.StreamError) as e:
        out["closed"] = repr(e)


async def _load(client: httpx.AsyncClient, url: str, n: int, max_tokens: int,
                action: Any) -> list[dict[str, Any]]:
    """``n`` streams; ``action()`` once every stream has its first token; returns their ends."""
    outs: list[dict[str, Any]] = [{} for _ in range(n)]
    events = [trio.Event() for _ in range(n)]
    with trio.fail_after(90):  # never a hang
        async with trio.open_nursery() as nursery:
            for o, ev in zip(outs, events):
                nursery.start_soon(_stream, client, url, max_tokens, o, ev)
            for ev in events:
                await ev.wait()
            await action()
    return outs


def _names(c: _Cluster) -> tuple[str, str]:
    return "default-0-dev0", "default-1-dev1"


async def _nothing() -> None:
    return None


async def test_cluster_serves_survives_kill_and_drains(calserve_home: Path, tmp_path: Path) -> None:
    c = _Cluster(calserve_home, tmp_path)
    try:
        s0, s1 = _names(c)
        c.wait_status({s0: "UP", s1: "UP"})
        reps = c.replicas()
        assert [(r["device"], r["pool"]) for r in reps] == [(0, "default"), (1, "default")]
        assert all(isinstance(r["pid"], int) and isinstance(r["port"], int) for r in reps)
        # every path goes through HAProxy
        assert httpx.get(c.url + "/ready", timeout=5).json()["status"] == "ready"
        assert httpx.get(c.url + "/v1/models", timeout=5).json()["data"][0]["id"] == "qwen3"
        assert "calserve_engine_up" in httpx.get(c.url + "/metrics", timeout=5).text
        limits = httpx.Limits(max_connections=100, max_keepalive_connections=100)
        async with httpx.AsyncClient(timeout=httpx.Timeout(60.0), limits=limits) as client:
            # 1. both replicas serve
            outs = await _load(client, c.url, 12, 12, _nothing)
            assert all(o["status"] == 200 and o["done"] for o in outs), outs
            per = [total(scrape(f"http://127.0.0.1:{r['port']}"), "calserve_completion_tokens_total")
                   for r in reps]
            assert all(p > 0 for p in per) and sum(per) >= 12 * 12, per
            assert {o["server"] for o in outs} == {s0, s1}

            # 1b. a stored response (POST /v1/responses) kept by one replica is continued and
            # read through the other (they share CALSERVE_HOME's store), and through HAProxy
            urls = [f"http://127.0.0.1:{r['port']}/v1/responses" for r in reps]
            kw = {"model": "qwen3", "max_output_tokens": 3, "temperature": 0}
            prev = None
            for k in range(4):
                r = await client.post(urls[k % 2], json={**kw, "input": f"turn {k}",
                                                        "previous_response_id": prev})
                assert r.status_code == 200, r.text
                prev = r.json()["id"]
            r = await client.get(f"{c.url}/v1/responses/{prev}/input_items?order=asc")
            assert r.status_code == 200, r.text
            turns = [i["content"][0]["text"] for i in r.json()["data"] if i["role"] == "user"]
            assert turns == [f"turn {k}" for k in range(4)]

            # 2. kill -9 of replica 0 under load: only its streams end, none hangs
            victim = reps[0]["pid"]

            async def kill() -> None:
                os.kill(victim, signal.SIGKILL)

            t_kill = time.monotonic()
            outs = await _load(client, c.url, 12, 40, kill)
            on0 = [o for o in outs if o["server"] == s0]
            on1 = [o for o in outs if o["server"] == s1]
            assert on0 and on1 and len(on0) + len(on1) == 12, outs
            assert all(o["done"] and not o["error"] for o in on1), on1
            assert all(not o["done"] and (o["closed"] or o["error"]) for o in on0), on0

            # 3. after the health check noticed: every request succeeds on the other replica
            await trio.sleep(max(0.0, t_kill + 3 * _CHECK_MS / 1000 - time.monotonic()))
            for _ in range(10):
                r = await client.post(c.url + "/v1/completions", json={
                    "model": "qwen3", "prompt": "after", "max_tokens": 2})
                assert r.status_code == 200, r.text
                if r.headers["x-calserve-server"] == s0:  # restarted already: fine too
                    continue
                assert r.headers["x-calserve-server"] == s1

            # 4. the supervisor restarts it and HAProxy takes it back
            deadline = time.monotonic() + 60
            while c.replicas()[0]["pid"] == victim:
                assert time.monotonic() < deadline, c.output()
                await trio.sleep(0.1)
            new_pid = c.replicas()[0]["pid"]
            assert c.replicas()[0]["device"] == 0 and c.replicas()[1]["pid"] == reps[1]["pid"]
            await trio.to_thread.run_sync(c.wait_status, {s0: "UP", s1: "UP"})
            outs = await _load(client, c.url, 8, 4, _nothing)
            assert all(o["done"] for o in outs) and s0 in {o["server"] for o in outs}, outs

            # 5. SIGTERM to the cluster: every admitted stream completes, all exit 0
            async def term() -> None:
                c.proc.send_signal(signal.SIGTERM)

            outs = await _load(client, c.url, 12, 30, term)
            assert all(o["status"] == 200 and o["done"] and not o["error"] for o in outs), outs
        rc = await trio.to_thread.run_sync(c.proc.wait, 60)
        assert rc == 0, c.output()
        for pid in (new_pid, reps[1]["pid"]):
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
        out = c.output()
        assert out.count("exited 0") == 3, out  # two replicas and haproxy
    finally:
        c.close()


def test_missing_haproxy_names_the_package(tmp_path: Path, calserve_home: Path) -> None:
    env = server_env(calserve_home)
    env["PATH"] = str(tmp_path)  # no haproxy here
    r = subprocess.run([sys.executable, "-m", "calserve.cli", "cluster", "--replicas", "1",
                        "--port", str(_free_port()), "--run-dir", str(tmp_path / "run")],
                       env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "apt-get install haproxy" in r.stderr, r.stderr
