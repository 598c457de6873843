"""Start real server processes on 127.0.0.1 for end-to-end tests."""

from __future__ import annotations

import contextlib
import os
import re
import resource
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

_RUNNING = re.compile(r"Running on http://127\.0\.0\.1:(\d+)")


class ServerProcess:
    """A server subprocess; stderr is collected by a thread (never blocks the pipe)."""

    def __init__(self, argv: Sequence[str], env: dict[str, str], cwd: Path,
                 nofile: int | None = None) -> None:
        def limit_fds() -> None:  # in the child: RLIMIT_NOFILE soft and hard = ``nofile``
            if nofile is not None:
                resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

        self.proc = subprocess.Popen(
            list(argv), env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            text=True, start_new_session=True, preexec_fn=limit_fds if nofile else None,
        )
        self.lines: list[str] = []
        self.port: int | None = None
        self._got_port = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line)
            m = _RUNNING.search(line)
            if m and self.port is None:
                self.port = int(m.group(1))
                self._got_port.set()
        self._got_port.set()

    @property
    def stderr(self) -> str:
        return "".join(self.lines)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        if not self._got_port.wait(timeout) or self.port is None:
            raise RuntimeError(f"server did not bind:\n{self.stderr}")
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited {self.proc.returncode}:\n{self.stderr}")
            try:
                if httpx.get(self.url + "/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"server not ready after {timeout}s:\n{self.stderr}")

    def stop(self, sig: int = signal.SIGINT, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._reader.join(5)
        if self.proc.stderr is not None:
            self.proc.stderr.close()
        return self.proc.returncode


def server_env(home: Path, config: Path | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["CALSERVE_HOME"] = str(home)
    env.pop("CALSERVE_CONFIG", None)
    if config is not None:
        env["CALSERVE_CONFIG"] = str(config)
    return env


def start_hypercorn(home: Path, config: Path | None = None, *, trio_worker: bool = True,
                    cwd: Path, nofile: int | None = None) -> ServerProcess:
    argv = [sys.executable, "-m", "hypercorn", "-b", "127.0.0.1:0", "--graceful-timeout", "5"]
    if trio_worker:
        argv += ["-k", "trio"]
    argv.append("calserve:app")
    return ServerProcess(argv, server_env(home, config), cwd, nofile)


@contextlib.contextmanager
def serving(home: Path, cwd: Path, config_yaml: str | None = None) -> Iterator[ServerProcess]:
    """A ready hypercorn (trio worker) server for a fixture; always stopped on exit. ``config_yaml``
    (if given) is written to ``cwd/calserve.yaml`` and served as the config file."""
    config = None
    if config_yaml is not None:
        config = cwd / "calserve.yaml"
        config.write_text(config_yaml)
    proc = start_hypercorn(home, config, cwd=cwd)
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


def start_calserve_serve(home: Path, *args: str, cwd: Path,
                         nofile: int | None = None) -> ServerProcess:
    argv = [sys.executable, "-m", "calserve.cli", "serve", "--port", "0", *args]
    return ServerProcess(argv, server_env(home), cwd, nofile)


@contextlib.contextmanager
def serving_calserve(home: Path, cwd: Path, *args: str) -> Iterator[ServerProcess]:
    """A ready ``calserve serve`` (its own listener) for a fixture; always stopped on exit."""
    proc = start_calserve_serve(home, *args, cwd=cwd)
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


def open_fds(pid: int) -> int:
    """How many file descriptors process ``pid`` has open (Linux)."""
    return len(os.listdir(f"/proc/{pid}/fd"))


def serving_pid(proc: ServerProcess) -> int:
    """The pid that serves: the hypercorn CLI's worker (it always forks one), else the process."""
    pid = proc.proc.pid
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return pid
    return int(children[0]) if children else pid


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """``/metrics`` as {(sample name, sorted labels): value}."""
    text = httpx.get(url + "/metrics", timeout=10).text
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(m: dict[Any, float], name: str, **labels: str) -> float:
    return m.get((name, tuple(sorted(labels.items()))), 0.0)


def total(m: dict[Any, float], name: str) -> float:
    return sum(v for (n, _), v in m.items() if n == name)
