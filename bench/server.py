"""Start and always stop a server subprocess for a benchmark run.

``with Server.calserve(config_dict, run_dir) as srv:`` writes ``run_dir/config.yaml``, starts
``python -m bench.serve_entry --config ... --port P`` on a free 127.0.0.1 port (pinned to core 0 with
``taskset`` when available; the load generator pins itself to core 1 with :func:`pin_self`; ``core=None``:
every CPU the generator had before it pinned itself), waits for
``GET /ready`` == 200, captures stdout+stderr to ``run_dir/server.log``, and on exit sends SIGINT, then
SIGTERM, then SIGKILL, whatever happened inside the block.

``CALSERVE_HOME`` defaults to ``bench/out/.home`` (the demo package is built there once), so benchmarks
never touch the operator's own home; set ``CALSERVE_HOME`` to override.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import yaml

__all__ = ["Server", "affinity_prefix", "free_port", "pin_self", "BENCH_OUT", "REPO"]

REPO = Path(__file__).resolve().parent.parent
BENCH_OUT = REPO / "bench" / "out"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


#: The CPUs this process could run on before :func:`pin_self` pinned it (None: never pinned). A
#: server started with ``core=None`` gets them: a child inherits its parent's affinity, so an
#: "unpinned" server started by a pinned load generator would otherwise share the generator's core.
_UNPINNED_CPUS: set[int] | None = None


def pin_self(core: int = 1) -> bool:
    """Pin this process (the load generator) to ``core`` when the machine has it."""
    global _UNPINNED_CPUS
    try:
        if core < (os.cpu_count() or 1):
            if _UNPINNED_CPUS is None:
                _UNPINNED_CPUS = set(os.sched_getaffinity(0))
            os.sched_setaffinity(0, {core})
            return True
    except (AttributeError, OSError):
        pass
    return False


def affinity_prefix(core: int | None) -> list[str]:
    """The ``taskset`` prefix of a server's command: ``core``, or with ``core=None`` every CPU this
    process had before :func:`pin_self` (nothing when it never pinned itself, or without taskset)."""
    if not shutil.which("taskset"):
        return []
    if core is not None:
        return ["taskset", "-c", str(core)] if core < (os.cpu_count() or 1) else []
    if _UNPINNED_CPUS is None:
        return []
    return ["taskset", "-c", ",".join(str(c) for c in sorted(_UNPINNED_CPUS))]


def _get(port: int, path: str, timeout: float = 2.0) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


class Server:
    """A running server subprocess (use the classmethod context managers)."""

    def __init__(self, proc: subprocess.Popen[bytes], port: int, log_path: Path) -> None:
        self.proc = proc
        self.port = port
        self.log_path = log_path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def exit_code(self) -> int | None:
        """None while it runs; the exit code (negative = signal) if it died."""
        return self.proc.poll()

    def get(self, path: str) -> tuple[int, bytes]:
        return _get(self.port, path)

    @classmethod
    @contextlib.contextmanager
    def start(cls, argv: list[str], run_dir: Path, *, ready_path: str = "/ready",
              port: int | None = None, env: dict[str, str] | None = None, core: int | None = 0,
              ready_timeout: float = 180.0, log_name: str = "server.log") -> Iterator[Server]:
        """Run ``argv`` (``{port}`` is substituted) until the block ends."""
        run_dir.mkdir(parents=True, exist_ok=True)
        port = port or free_port()
        cmd = [a.replace("{port}", str(port)) for a in argv]
        cmd = affinity_prefix(core) + cmd  # core=None: every CPU, not the load generator's one
        full_env = dict(os.environ)
        full_env.setdefault("CALSERVE_HOME", str(BENCH_OUT / ".home"))
        full_env["PYTHONPATH"] = str(REPO) + os.pathsep + full_env.get("PYTHONPATH", "")
        full_env.setdefault("PYTHONFAULTHANDLER", "1")  # a crash in C leaves a trace in the log
        full_env.update(env or {})
        log_path = run_dir / log_name
        log: IO[bytes] = log_path.open("wb")
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env, cwd=REPO,
                                start_new_session=True)
        srv = cls(proc, port, log_path)
        try:
            srv._wait_ready(ready_path, ready_timeout)
            yield srv
        finally:
            srv._stop()
            log.close()

    @classmethod
    @contextlib.contextmanager
    def calserve(cls, config: dict[str, Any], run_dir: Path, *, core: int | None = 0,
                 **kw: Any) -> Iterator[Server]:
        """Start calserve with ``config`` (a dict in the ``calserve.config`` schema)."""
        run_dir.mkdir(parents=True, exist_ok=True)
        port = free_port()
        cfg = {**config, "server": {**config.get("server", {}), "host": "127.0.0.1", "port": port}}
        cfg_path = run_dir / "config.yaml"
        cfg_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        argv = [sys.executable, "-m", "bench.serve_entry", "--config", str(cfg_path),
                "--host", "127.0.0.1", "--port", "{port}"]
        with cls.start(argv, run_dir, port=port, core=core, **kw) as srv:
            yield srv

    def _wait_ready(self, path: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} before ready; "
                                   f"log {self.log_path}:\n{self._tail()}")
            try:
                status, _ = _get(self.port, path, timeout=1.0)
                if status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"server not ready after {timeout:.0f}s; log {self.log_path}:\n"
                           f"{self._tail()}")

    def _tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def _stop(self) -> None:
        """SIGINT (graceful), then SIGTERM, then SIGKILL to the whole session: never leaks."""
        if self.proc.poll() is None:
            for sig, wait in ((signal.SIGINT, 10.0), (signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
                try:
                    os.killpg(self.proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.proc.wait(wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
        self.returncode = self.proc.returncode
