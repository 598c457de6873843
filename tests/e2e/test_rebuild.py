"""A rebuild of the C extension in the checkout a server runs from must not crash that server.

README command 2 (``pip install -e '.[test]'``) in the clone where command 1's server runs rebuilds
``calserve/_calrt*.so`` and ``calserve/libcalrt_sim.so`` in that clone. The copy step of both is
``setup.py``'s ``BuildCalrt`` (the editable install runs ``build_ext`` with the outputs copied into
the source tree, exactly as ``build_ext --inplace`` does); an editable install in a fresh venv
would cost minutes on 2 cores, so the test runs ``python setup.py build_ext --inplace`` in the copy
with the test's own interpreter. The outputs must be replaced (a new inode), never rewritten in
place: the server keeps executing its mapped copy.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

import calserve

from .server import ServerProcess, server_env

pytestmark = pytest.mark.timeout(600)

ROOT = Path(calserve.__file__).resolve().parent.parent
_IGNORE = shutil.ignore_patterns(".git", ".venv", "build", "__pycache__", "*.pyc", ".pytest_cache",
                                 ".hypothesis", ".mypy_cache", "*.egg-info", "out", "tests")
_LIBS = ("libcalrt_sim.so",)


def _copy_checkout(dst: Path) -> Path:
    tree = dst / "checkout"
    shutil.copytree(ROOT, tree, ignore=_IGNORE)
    return tree


def _build(tree: Path) -> None:
    r = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=tree,
                       capture_output=True, text=True, timeout=400,
                       env={**os.environ, "PYTHONPATH": str(tree)})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


def _mapped(pid: int, tree: Path) -> list[str]:
    """Lines of /proc/PID/maps that map a file of ``tree``'s package."""
    pkg = str(tree / "calserve")
    with open(f"/proc/{pid}/maps") as f:
        return sorted({line.split(None, 5)[-1].strip() for line in f if pkg in line})


def _complete(url: str) -> str:
    r = httpx.post(url + "/v1/completions", timeout=60, json={
        "model": "qwen3", "prompt": "The rebuild", "max_tokens": 12, "temperature": 0})
    assert r.status_code == 200, r.text
    text = r.json()["choices"][0]["text"]
    assert isinstance(text, str)
    return text


def test_running_server_survives_an_inplace_rebuild(calserve_home: Path, tmp_path: Path) -> None:
    tree = _copy_checkout(tmp_path)
    _build(tree)
    env = server_env(calserve_home)
    env["PYTHONPATH"] = str(tree)
    argv = [sys.executable, "-m", "hypercorn", "-b", "127.0.0.1:0", "-k", "trio", "calserve:app"]
    proc = ServerProcess(argv, env, tree)
    try:
        proc.wait_ready()
        # The server's worker (hypercorn forks one) runs the copy's extension and runtime.
        worker = _worker_pid(proc.proc.pid, tree)
        before = _complete(proc.url)
        lib = tree / "calserve" / _LIBS[0]
        inode = lib.stat().st_ino
        # An update of the C sources (new code, new layout), then README command 2's copy step.
        with open(tree / "ext" / "calrt" / "sim" / "device.c", "a") as f:
            f.write("\nint calrt_sim_rebuild_marker(int x);\n"
                    "int calrt_sim_rebuild_marker(int x) { return x * 7 + 3; }\n")
        _build(tree)
        assert lib.stat().st_ino != inode, "libcalrt_sim.so was rewritten in place"
        for _ in range(3):
            assert _complete(proc.url) == before
        assert httpx.get(proc.url + "/metrics", timeout=30).status_code == 200
        assert proc.proc.poll() is None, proc.stderr
        # What the worker still runs is the replaced (deleted) file, not the rewritten path.
        maps = _mapped(worker, tree)
        assert any(m.endswith("libcalrt_sim.so (deleted)") for m in maps), maps
    finally:
        proc.stop()
    assert "Segmentation" not in proc.stderr and "Bus error" not in proc.stderr, proc.stderr


def _worker_pid(parent: int, tree: Path) -> int:
    """hypercorn's CLI serves from a forked worker: the child of ``parent`` that maps ``tree``'s
    runtime."""
    for child in Path(f"/proc/{parent}/task/{parent}/children").read_text().split():
        if any(m.endswith("libcalrt_sim.so") for m in _mapped(int(child), tree)):
            return int(child)
    raise AssertionError(f"no child of {parent} runs {tree}'s libcalrt_sim.so")
