"""``calserve cluster``: several boards on one machine — N ``calserve serve --device i`` processes
behind a real HAProxy.

::

    calserve cluster --replicas N [--config FILE] [--pool-config FILE] --port PORT --run-dir DIR

It renders ``deploy/haproxy/haproxy.cfg`` into ``DIR/haproxy.cfg`` (checked with ``haproxy -c``),
starts ``haproxy`` on ``--port`` (every path is forwarded: ``/v1/...``, ``/ready``, ``/metrics``) and
one ``calserve serve --device i --port p`` per replica, and supervises them: a process that exits is
restarted with a backoff (0.5 s doubling to 10 s; back to 0.5 s after a run of 30 s); ``SIGTERM`` or
``SIGINT`` is forwarded to every replica, which drains (``server.drain_timeout_s``; a second
signal is forwarded too and shortens their wait), then HAProxy is stopped softly. Balancing and
health checks are HAProxy's; this only runs processes.

``DIR/replicas.json`` = ``[{"device", "port", "pid", "pool"}, ...]`` (pid: the ``calserve serve``
process itself) is replaced atomically (temp file + rename) when the replicas start and on every
restart; ``DIR/prometheus-targets.json`` (Prometheus file_sd) beside it. Logs: ``DIR/<name>.log``.

Exit: 0 when every replica and HAProxy stopped cleanly after a signal, 1 otherwise (or on a
refused start: no haproxy, bad pool file, a port in use).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any, Final

import trio

from calserve.cluster_config import (PoolFile, Replica, load_pools, plan_replicas, render_haproxy,
                                     single_pool, template_path)
from calserve.errors import CalserveError, ConfigError

__all__ = ["main", "build_parser", "Cluster"]

log = logging.getLogger("calserve.cluster")

_BACKOFF_MIN_S: Final = 0.5
_BACKOFF_MAX_S: Final = 10.0
_STABLE_S: Final = 30.0  # a run this long resets the backoff
_HAPROXY_STOP_S: Final = 10.0  # soft stop (SIGUSR1) of HAProxy, then SIGTERM
MISSING_HAPROXY: Final = ("haproxy is not installed (not on PATH): install the Debian/Ubuntu "
                          "package `haproxy` (apt-get install haproxy; 2.6 or newer)")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="calserve cluster", description=(
        "Run N `calserve serve --device i` replicas behind HAProxy on one machine."))
    ap.add_argument("--replicas", type=int, metavar="N",
                    help="replicas of the one pool (required without --pool-config)")
    ap.add_argument("--config", metavar="FILE", help="calserve config of every replica "
                    "(without --pool-config)")
    ap.add_argument("--pool-config", metavar="FILE", help="pool file (calserve/cluster_config.py "
                    "and deploy/README.md describe its format)")
    ap.add_argument("--port", type=int, required=True, help="HAProxy's port (clients connect here)")
    ap.add_argument("--host", default="127.0.0.1", help="HAProxy's listen address")
    ap.add_argument("--stats-port", type=int, default=8404,
                    help="HAProxy stats page and its /metrics on 127.0.0.1 (default 8404)")
    ap.add_argument("--run-dir", required=True, metavar="DIR",
                    help="haproxy.cfg, replicas.json, logs")
    ap.add_argument("--check-interval-ms", type=int, default=1000,
                    help="HAProxy's health check interval on /ready (default 1000)")
    ap.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return ap


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports free on 127.0.0.1 right now."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def write_atomic(path: Path, data: Any) -> None:
    """JSON to ``path`` via a temp file in the same directory + rename (readers never see half)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class _Child:
    """One supervised process (a replica or HAProxy) and its restarts."""

    def __init__(self, name: str, argv: list[str], logfile: Path) -> None:
        self.name = name
        self.argv = argv
        self.logfile = logfile
        self.proc: trio.Process | None = None
        self.restarts = 0
        self.last_rc: int | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    async def start(self) -> None:
        out: IO[bytes] = open(self.logfile, "ab")
        try:
            self.proc = await trio.lowlevel.open_process(
                self.argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True)  # our signals are forwarded deliberately, not by the tty
        finally:
            out.close()

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.returncode is None:
            try:
                self.proc.send_signal(sig)
            except ProcessLookupError:
                pass


class Cluster:
    def __init__(self, a: argparse.Namespace, pools: PoolFile, replicas: list[Replica],
                 run_dir: Path) -> None:
        self.a = a
        self.pools = pools
        self.replicas = replicas
        self.run_dir = run_dir
        self.stopping = False
        self.children: dict[str, _Child] = {}
        self.haproxy: _Child | None = None
        self._inner: trio.Nursery | None = None

    # ---------------------------------------------------------------------------- files
    def write_state(self) -> None:
        rows = []
        targets = []
        for r in self.replicas:
            ch = self.children[r.name]
            rows.append({"device": r.device, "port": r.port, "pid": ch.pid, "pool": r.pool})
            targets.append({"targets": [f"127.0.0.1:{r.port}"],
                            "labels": {"pool": r.pool, "device": str(r.device)}})
        write_atomic(self.run_dir / "replicas.json", rows)
        write_atomic(self.run_dir / "prometheus-targets.json", targets)

    def replica_argv(self, r: Replica) -> list[str]:
        argv = [sys.executable, "-m", "calserve.cli", "serve", "--device", str(r.device),
                "--host", "127.0.0.1", "--port", str(r.port), "--log-level", self.a.log_level]
        if r.config is not None:
            argv += ["--config", r.config]
        return argv

    # ---------------------------------------------------------------------------- run
    async def run(self) -> int:
        haproxy = shutil.which("haproxy")
        assert haproxy is not None
        cfg = self.run_dir / "haproxy.cfg"
        self.haproxy = _Child("haproxy", [haproxy, "-db", "-f", str(cfg)],
                              self.run_dir / "haproxy.log")
        for r in self.replicas:
            self.children[r.name] = _Child(r.name, self.replica_argv(r),
                                           self.run_dir / f"{r.name}.log")
        async with trio.open_nursery() as outer:
            await outer.start(self._signals)  # before any child: a signal is never lost
            async with trio.open_nursery() as inner:
                self._inner = inner
                await self.haproxy.start()
                for r in self.replicas:
                    await self.children[r.name].start()
                self.write_state()
                log.info("cluster: HAProxy on http://%s:%d (stats http://127.0.0.1:%d/), "
                         "%d replicas: %s", self.a.host, self.a.port, self.a.stats_port,
                         len(self.replicas), ", ".join(
                             f"{r.name} board {r.device} :{r.port}" for r in self.replicas))
                inner.start_soon(self._supervise, self.haproxy, None)
                for r in self.replicas:
                    inner.start_soon(self._supervise, self.children[r.name], r)
                if self.stopping:  # a signal came while the children started
                    self._begin_stop()
            outer.cancel_scope.cancel()
        ok = all(ch.last_rc == 0 for ch in self.children.values())
        hap_rc = self.haproxy.last_rc
        if not ok:
            log.error("cluster: replicas exited with %s",
                      {n: ch.last_rc for n, ch in self.children.items()})
        if hap_rc not in (0, None):
            log.error("cluster: haproxy exited with %s", hap_rc)
        return 0 if ok and hap_rc in (0, None) else 1

    async def _signals(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                       ) -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as sigs:
            task_status.started()
            async for s in sigs:
                name = signal.Signals(s).name
                if not self.stopping:
                    log.info("cluster: %s: draining every replica", name)
                    self.stopping = True
                    if self._inner is not None:
                        self._begin_stop()
                else:
                    log.warning("cluster: %s again: forwarded (replicas shorten their drain)", name)
                    for ch in self.children.values():
                        ch.signal(signal.SIGTERM)

    def _begin_stop(self) -> None:
        for ch in self.children.values():
            ch.signal(signal.SIGTERM)
        assert self._inner is not None
        self._inner.start_soon(self._stop_haproxy_after_replicas)

    async def _stop_haproxy_after_replicas(self) -> None:
        """Once every replica is gone, stop HAProxy softly (it lets open streams finish)."""
        for ch in self.children.values():
            if ch.proc is not None:
                await ch.proc.wait()
        hap = self.haproxy
        if hap is None or hap.proc is None:
            return
        hap.signal(signal.SIGUSR1)
        with trio.move_on_after(_HAPROXY_STOP_S):
            await hap.proc.wait()
            return
        log.warning("cluster: haproxy did not stop softly within %g s: SIGTERM", _HAPROXY_STOP_S)
        hap.signal(signal.SIGTERM)

    async def _supervise(self, ch: _Child, replica: Replica | None) -> None:
        backoff = _BACKOFF_MIN_S
        while True:
            assert ch.proc is not None
            started = trio.current_time()
            rc = await ch.proc.wait()
            ch.last_rc = rc
            if self.stopping:
                log.info("cluster: %s exited %d", ch.name, rc)
                return
            ran = trio.current_time() - started
            if ran >= _STABLE_S:
                backoff = _BACKOFF_MIN_S
            log.warning("cluster: %s (pid %s) exited %d after %.1f s: restarting in %.1f s (log: %s)",
                        ch.name, ch.pid, rc, ran, backoff, ch.logfile)
            await trio.sleep(backoff)
            backoff = min(_BACKOFF_MAX_S, backoff * 2)
            if self.stopping:
                return
            await ch.start()
            ch.restarts += 1
            ch.last_rc = None
            if replica is not None:
                self.write_state()
            log.info("cluster: %s restarted (pid %s, restart %d)", ch.name, ch.pid, ch.restarts)


def prepare(a: argparse.Namespace) -> Cluster:
    """Check everything that can be checked before a process starts (clear errors)."""
    if shutil.which("haproxy") is None:
        raise CalserveError(MISSING_HAPROXY)
    if a.pool_config:
        pools = load_pools(a.pool_config)
        total = sum(p.replicas for p in pools.pools.values())
        if a.replicas is not None and a.replicas != total:
            raise ConfigError(f"--replicas {a.replicas} but the pool file has {total} replicas")
        if a.config:
            raise ConfigError("--config and --pool-config: give each pool's config in the pool file")
    else:
        if a.replicas is None:
            raise ConfigError("--replicas N is required without --pool-config")
        pools = single_pool(a.replicas, a.config)
        if a.config and not Path(a.config).is_file():
            raise ConfigError(f"--config: {a.config} does not exist")
    n = sum(p.replicas for p in pools.pools.values())
    replicas = plan_replicas(pools, free_ports(n))
    run_dir = Path(a.run_dir).expanduser().resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    drain = max((_drain_timeout(r.config) for r in replicas), default=30.0)
    text = render_haproxy(template_path().read_text(), pools, replicas, bind_host=a.host,
                          port=a.port, stats_port=a.stats_port, check_inter_ms=a.check_interval_ms,
                          hard_stop_after_s=int(drain) + 30)
    cfg = run_dir / "haproxy.cfg"
    cfg.write_text(text)
    chk = subprocess.run([shutil.which("haproxy") or "haproxy", "-c", "-q", "-f", str(cfg)],
                         capture_output=True, text=True, timeout=30)
    if chk.returncode != 0:
        raise ConfigError(f"{cfg}: haproxy -c refused it: {(chk.stderr or chk.stdout).strip()}")
    for port in (a.port, a.stats_port):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((a.host if port == a.port else "127.0.0.1", port))
            except OSError as e:
                raise ConfigError(f"port {port} is not free: {e.strerror}") from None
    return Cluster(a, pools, replicas, run_dir)


def _drain_timeout(config: str | None) -> float:
    from calserve.config import load_config

    return load_config(config).server.drain_timeout_s if config else 30.0


def main(argv: Sequence[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    logging.basicConfig(level=a.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cluster = prepare(a)
    except CalserveError as e:
        print(f"calserve cluster: {e.message}", file=sys.stderr)
        return 1
    return trio.run(cluster.run)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
