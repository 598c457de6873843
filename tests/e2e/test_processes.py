"""Process-level behaviour: asyncio worker refusal, `calserve serve --model`, exit codes."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai

import calserve

from .server import ServerProcess, server_env, start_calserve_serve, start_hypercorn


def test_asyncio_worker_refuses_with_a_message(calserve_home: Path, tmp_path: Path) -> None:
    proc = start_hypercorn(calserve_home, trio_worker=False, cwd=tmp_path)
    try:
        proc.proc.wait(60)
    except subprocess.TimeoutExpired:
        pass
    proc.stop()
    assert "-k trio" in proc.stderr, proc.stderr


def test_calserve_serve_model_flag(calserve_home: Path, tmp_path: Path) -> None:
    from calserve.models.demo import demo_package_path

    pkg = demo_package_path(calserve_home)
    proc = start_calserve_serve(calserve_home, "--model", str(pkg), "--alias", "mine",
                                cwd=tmp_path)
    try:
        proc.wait_ready()
        client = openai.OpenAI(base_url=proc.url + "/v1", api_key="x", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["mine"]
        r = client.completions.create(model="mine", prompt="hi", max_tokens=3)
        assert r.usage is not None and r.usage.completion_tokens >= 1
        assert httpx.get(proc.url + "/ready?model=mine").status_code == 200
    finally:
        rc = proc.stop(signal.SIGTERM)
    assert rc == 0, proc.stderr


def test_calserve_serve_refused_package_exits_1(calserve_home: Path, tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "calserve.cli", "serve", "--port", "0", "--model",
         str(tmp_path / "missing-pkg")],
        env=server_env(calserve_home), cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )
    assert r.returncode == 1, r.stderr
    # Listen first: the port opened, then the load failed; the reason is said once, then nothing
    # claims to serve.
    assert r.stderr.count("no such package directory") == 1, r.stderr
    assert "Traceback" not in r.stderr
    assert "Running on" not in r.stderr.split("no such package directory")[1], r.stderr


def test_hypercorn_cli_worker_exits_when_the_model_cannot_load(calserve_home: Path,
                                                              tmp_path: Path) -> None:
    """Under the hypercorn CLI the worker ends itself (exit 1) after saying why once, instead of
    serving 503s for ever; hypercorn's own parent process then exits 0 (hypercorn 0.18)."""
    config = tmp_path / "c.yaml"
    config.write_text(f"models:\n  qwen3:\n    package: {tmp_path / 'missing-pkg'}\n"
                      f"trust:\n  model_root: {tmp_path}\n")
    proc = start_hypercorn(calserve_home, config, cwd=tmp_path)
    try:
        proc.proc.wait(120)
    finally:
        proc.stop()
    assert proc.stderr.count("no such package directory") == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "Running on" not in proc.stderr.split("no such package directory")[1], proc.stderr


def test_hypercorn_cli_bad_config_said_once_and_no_running_line(calserve_home: Path,
                                                               tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("server: {port: -3}\n")
    proc = start_hypercorn(calserve_home, config, cwd=tmp_path)
    try:
        proc.proc.wait(120)
    finally:
        proc.stop()
    assert proc.stderr.count("$.server.port") == 1, proc.stderr
    assert "Running on" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_version_flag_and_routes(server: ServerProcess) -> None:
    r = subprocess.run([sys.executable, "-m", "calserve.cli", "--version"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == f"calserve {calserve.__version__}"
    assert httpx.get(server.url + "/version").json()["version"] == calserve.__version__
    models = httpx.get(server.url + "/v1/models").json()["data"]
    assert [m["server_version"] for m in models] == [calserve.__version__]


def test_demo_package_built_message_only_on_the_start_that_builds_it(server: ServerProcess) -> None:
    # The session's server started on a home whose demo package already existed.
    assert "first start" not in server.stderr, server.stderr


def test_one_version_number() -> None:
    import tomllib

    root = Path(calserve.__file__).resolve().parent.parent
    with open(root / "pyproject.toml", "rb") as f:
        assert tomllib.load(f)["project"]["version"] == calserve.__version__


def test_json_logs_and_request_ids_in_the_access_log(calserve_home: Path, tmp_path: Path) -> None:
    import json

    from calserve.models.demo import demo_package_path

    pkg = demo_package_path(calserve_home)
    proc = start_calserve_serve(calserve_home, "--model", str(pkg), "--alias", "qwen3",
                                "--log-format", "json", "--access-log", cwd=tmp_path)
    try:
        # ServerProcess finds the port in hypercorn's "Running on" message, inside the JSON line
        proc.wait_ready()
        r = httpx.post(proc.url + "/v1/completions", headers={"X-Request-Id": "trace-7"},
                       json={"model": "qwen3", "prompt": "x", "max_tokens": 0})
        assert r.status_code == 400 and r.headers["x-request-id"] == "trace-7"
        assert r.json()["request_id"] == "trace-7"
        r = httpx.get(proc.url + "/health")
        generated = r.headers["x-request-id"]
    finally:
        rc = proc.stop(signal.SIGTERM)
    assert rc == 0, proc.stderr
    records = [json.loads(line) for line in proc.lines if line.strip()]  # every line is JSON
    assert all({"ts", "level", "logger", "message"} <= set(r) for r in records)
    access = [r for r in records if r["logger"] == "hypercorn.access"]
    mine = [r for r in access if r.get("request_id") == "trace-7"]
    assert len(mine) == 1 and mine[0]["status"] == "400" and mine[0]["path"] == "/v1/completions"
    assert any(r.get("request_id") == generated and r["path"] == "/health" for r in access)


def _serve_config(home: Path, tmp_path: Path, yaml: str) -> subprocess.CompletedProcess[str]:
    config = tmp_path / "c.yaml"
    config.write_text(yaml)
    return subprocess.run(
        [sys.executable, "-m", "calserve.cli", "serve", "--port", "0", "--config", str(config)],
        env=server_env(home), cwd=tmp_path, capture_output=True, text=True, timeout=180)


def test_serve_config_with_a_profile_the_package_lacks_fails_start_up(calserve_home: Path,
                                                                      tmp_path: Path) -> None:
    """Spec §15: a B8 in the config that the package lacks fails start-up, through the path a
    user takes (`calserve serve --config`), before any weight is read — the cross-check of the
    configured profiles with the package's manifest (models.validate.check_scheduler_config)."""
    pkg = tmp_path / "b1b4"
    r = subprocess.run([sys.executable, "-m", "calserve.cli", "pack", "--demo", "--out", str(pkg),
                        "--profiles", "1,4"], env=server_env(calserve_home), cwd=tmp_path,
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr
    base = (f"models:\n  qwen3:\n    package: {pkg}\ntrust:\n  model_root: {tmp_path}\n")
    r = _serve_config(calserve_home, tmp_path, base + "runtime:\n  profile: sim-next\n"
                      "scheduler:\n  batch:\n    profiles: [8]\n")
    assert r.returncode == 1, r.stderr
    why = "$.scheduler.batch.profiles: B8 requested but package 'demo-qwen3' has only ['B1', 'B4']"
    assert r.stderr.count(why) == 1, r.stderr
    assert "Traceback" not in r.stderr
    # the runtime side of the same check: B4 is in the package, but not runnable on CalRT 0.7.6
    r = _serve_config(calserve_home, tmp_path, base + "scheduler:\n  batch:\n    profiles: [4]\n")
    assert r.returncode == 1, r.stderr
    assert r.stderr.count("$.scheduler.batch.profiles: B4 cannot run on runtime calrt-0.7.6") == 1


def test_first_start_listens_before_building_the_demo_package(tmp_path: Path) -> None:
    """A first start (empty CALSERVE_HOME): the port opens before the demo package is built, so a
    supervisor sees /health 200 and /ready 503 ``loading`` meanwhile, then /ready 200."""
    home = tmp_path / "home"
    home.mkdir()
    with socket.socket() as s:  # a free port known before start: hypercorn's "Running on" line
        s.bind(("127.0.0.1", 0))  # comes late (logged after the lifespan start-up)
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "hypercorn", "-k", "trio", "-b", f"127.0.0.1:{port}",
            "calserve:app"]
    proc = ServerProcess(argv, server_env(home), tmp_path)
    try:
        deadline = time.monotonic() + 60
        seen: list[tuple[int, int, str]] = []
        while time.monotonic() < deadline:
            try:
                health = httpx.get(url + "/health", timeout=5).status_code
                r = httpx.get(url + "/ready", timeout=5)
            except httpx.HTTPError:  # not listening yet
                assert proc.proc.poll() is None, proc.stderr
                time.sleep(0.01)
                continue
            seen.append((health, r.status_code, r.json().get("reason", "")))
            if r.status_code == 200:
                break
            time.sleep(0.02)
        assert seen and seen[-1][1] == 200, (seen[-3:], proc.stderr)
        assert (200, 503, "loading") in seen, seen[:3]
        assert all(h == 200 for h, _, _ in seen)
        assert "built the demo package" in proc.stderr
    finally:
        proc.stop()
