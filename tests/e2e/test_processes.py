"""Process-level behaviour: asyncio worker refusal, `calserve serve --model`, exit codes."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import httpx
import openai

from .server import server_env, start_calserve_serve, start_hypercorn


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
    assert "missing-pkg" in r.stderr and "Traceback" not in r.stderr.split("could not serve")[-1]
