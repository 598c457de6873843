"""llama-server for the ``peer`` scenario: find it, or build it from the llama.cpp tree vendored in the
``llama-cpp-python`` sdist on PyPI, and the command line it is benchmarked with.

Looked up in this order: ``--llama-server PATH``, env ``LLAMA_SERVER``, ``llama-server`` on ``PATH``,
the cache (``$CALSERVE_PEER_CACHE`` or ``~/.cache/calserve/llama-server``: ``bin/llama-server`` there).
:func:`build_llama_server` (``--build``) fills the cache: ``pip download --no-binary :all:
llama-cpp-python==VERSION``, unpack, remove the vendored tree's stale ``.git`` file (a gitlink that
points nowhere: CMake's version probe would fail on it), then CMake + Ninja with ``-DLLAMA_CURL=OFF
-DLLAMA_OPENSSL=OFF -DGGML_NATIVE=ON`` and static libraries, target ``llama-server`` only (~6-25 min
on 2 cores). Needs ``cmake``, ``ninja`` and a C++ compiler (``apt-get install cmake ninja-build g++``
or ``pip install cmake ninja``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

__all__ = ["LLAMA_CPP_PYTHON", "PeerUnavailable", "cache_dir", "find_llama_server",
           "build_llama_server", "llama_server_argv", "llama_server_version"]

LLAMA_CPP_PYTHON = "0.3.36"  # the sdist whose vendored llama.cpp is built


class PeerUnavailable(RuntimeError):
    """No llama-server could be found or built; the message says what to do."""


def cache_dir() -> Path:
    env = os.environ.get("CALSERVE_PEER_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "calserve" / "llama-server"


def _usable(p: Path | None) -> Path | None:
    if p is not None and p.is_file() and os.access(p, os.X_OK):
        return p.resolve()
    return None


def find_llama_server(explicit: str | os.PathLike[str] | None = None) -> Path | None:
    """The first usable llama-server of: ``explicit``, ``$LLAMA_SERVER``, ``PATH``, the cache."""
    if explicit is not None:
        p = _usable(Path(explicit))
        if p is None:
            raise PeerUnavailable(f"--llama-server {explicit}: not an executable file")
        return p
    env = os.environ.get("LLAMA_SERVER")
    if env:
        p = _usable(Path(env))
        if p is None:
            raise PeerUnavailable(f"LLAMA_SERVER={env}: not an executable file")
        return p
    on_path = shutil.which("llama-server")
    if on_path:
        return _usable(Path(on_path))
    return _usable(cache_dir() / "bin" / "llama-server")


def _run(cmd: list[str], log: Path, cwd: Path | None = None) -> None:
    with log.open("ab") as f:
        f.write(("$ " + " ".join(cmd) + "\n").encode())
        f.flush()
        rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=cwd)
    if rc != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
        raise PeerUnavailable(f"{cmd[0]} {' '.join(cmd[1:3])} ... failed ({rc}); log {log}:\n{tail}")


def build_llama_server(dest: Path | None = None, *, version: str = LLAMA_CPP_PYTHON,
                       jobs: int = 2, src_dir: Path | None = None) -> Path:
    """Build llama-server into ``dest`` (default :func:`cache_dir`) and return ``dest/bin/llama-server``.

    ``src_dir``: an already unpacked ``llama-cpp-python`` sdist (skips the download)."""
    dest = dest or cache_dir()
    dest.mkdir(parents=True, exist_ok=True)
    for tool in ("cmake", "ninja"):
        if shutil.which(tool) is None:
            raise PeerUnavailable(f"building llama-server needs {tool!r} on PATH "
                                  "(apt-get install cmake ninja-build g++, or pip install cmake ninja)")
    log = dest / "build.log"
    print(f"building llama-server (llama-cpp-python {version} sdist) into {dest}; log {log}; "
          "this takes ~6-25 min on 2 cores", file=sys.stderr, flush=True)
    work = Path(tempfile.mkdtemp(prefix="llama-src-", dir=dest))
    try:
        if src_dir is None:
            _run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
                  f"llama-cpp-python=={version}", "-d", str(work)], log)
            sdists = sorted(work.glob("llama_cpp_python-*.tar.gz"))
            if not sdists:
                raise PeerUnavailable(f"pip download gave no llama-cpp-python sdist; log {log}")
            with tarfile.open(sdists[0]) as tf:
                tf.extractall(work, filter="data")
            src_dir = next(p for p in work.iterdir() if p.is_dir())
        tree = src_dir / "vendor" / "llama.cpp"
        if not (tree / "CMakeLists.txt").is_file():
            raise PeerUnavailable(f"{tree}: no vendored llama.cpp tree in the sdist")
        stale = tree / ".git"
        if stale.is_file():  # a gitlink into the sdist author's checkout
            stale.unlink()
        build = dest / "build"
        _run(["cmake", "-S", str(tree), "-B", str(build), "-G", "Ninja", "-DLLAMA_CURL=OFF",
              "-DLLAMA_OPENSSL=OFF", "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_BUILD_SERVER=ON",
              "-DLLAMA_BUILD_TESTS=OFF", "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF"], log)
        _run(["cmake", "--build", str(build), "--target", "llama-server", "-j", str(jobs)], log)
        built = build / "bin" / "llama-server"
        if _usable(built) is None:
            raise PeerUnavailable(f"the build finished without {built}; log {log}")
        (dest / "bin").mkdir(exist_ok=True)
        shutil.copy2(built, dest / "bin" / "llama-server")
        (dest / "VERSION").write_text(f"llama-cpp-python {version}\n")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return dest / "bin" / "llama-server"


def llama_server_version(binary: Path) -> str:
    """``llama-server --version``'s first line (``version: N (commit)``), or ``?``."""
    try:
        r = subprocess.run([str(binary), "--version"], capture_output=True, timeout=30, text=True)
    except (OSError, subprocess.TimeoutExpired):
        return "?"
    lines = [ln.strip() for ln in (r.stdout + r.stderr).splitlines() if ln.strip()]
    ver = next((ln for ln in lines if ln.startswith("version")), "?")
    built = next((ln for ln in lines if ln.startswith("built with")), "")
    return f"{ver}; {built}" if built else ver


def llama_server_argv(binary: Path, gguf: Path, *, parallel: int, ctx_per_slot: int,
                      threads: int) -> list[str]:
    """llama-server as benchmarked: ``parallel`` slots (one per stream) with continuous batching,
    ``ctx_per_slot`` tokens of context each (``-c`` is the total), ``threads`` for decode and batch,
    an F32 KV cache (as calserve's fp32 KV) and no web UI. ``{port}`` is filled in by the Server."""
    return [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", "{port}",
            "--parallel", str(parallel), "-c", str(parallel * ctx_per_slot), "--cont-batching",
            "-t", str(threads), "-tb", str(threads), "-ctk", "f32", "-ctv", "f32",
            "--no-webui"]
