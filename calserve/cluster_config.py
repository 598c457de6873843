"""What ``calserve cluster`` runs: the pool file, the replicas' placement, the rendered haproxy.cfg.

Pure (no processes): :func:`load_pools` reads ``--pool-config`` (or makes the one pool of
``--replicas N [--config FILE]``), :func:`plan_replicas` gives every replica its board and port,
:func:`render_haproxy` fills ``deploy/haproxy/haproxy.cfg`` (its template syntax is described at
its top). :mod:`calserve.cluster` starts and supervises the processes.

Pool file (YAML; paths are relative to the file)::

    default_pool: throughput          # where requests without (or with an unknown) X-Calserve-Pool go
    pools:
      latency:    {config: latency.yaml, replicas: 1}
      throughput: {config: throughput.yaml, replicas: 2, devices: [1, 2]}

``devices`` (optional) are the boards of the pool's replicas; by default boards are numbered
0, 1, ... across the pools in file order. Every board is used by one replica only.
"""

from __future__ import annotations

import re
import string
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Final

import msgspec

from calserve.errors import ConfigError

__all__ = ["PoolSpec", "PoolFile", "Replica", "load_pools", "single_pool", "plan_replicas",
           "render_haproxy", "template_path", "POOL_HEADER", "DEFAULT_POOL"]

POOL_HEADER: Final = "X-Calserve-Pool"
DEFAULT_POOL: Final = "default"
_NAME = re.compile(r"^[a-z][a-z0-9_-]{0,31}$")


class PoolSpec(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    replicas: Annotated[int, msgspec.Meta(ge=1, le=64)]
    config: str | None = None  # calserve config of the pool's replicas (None: the default)
    devices: list[Annotated[int, msgspec.Meta(ge=0)]] | None = None


class PoolFile(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    pools: dict[str, PoolSpec]
    default_pool: str | None = None  # None: "throughput" if there is one, else the first pool


@dataclass(frozen=True, slots=True)
class Replica:
    pool: str
    index: int  # within the pool
    device: int
    port: int
    config: str | None  # absolute path, or None

    @property
    def name(self) -> str:
        return f"{self.pool}-{self.index}"


def single_pool(replicas: int, config: str | None) -> PoolFile:
    """``--replicas N [--config FILE]`` without a pool file: one pool of N replicas."""
    if replicas < 1:
        raise ConfigError("--replicas must be >= 1")
    cfg = str(Path(config).expanduser().resolve()) if config else None
    return PoolFile({DEFAULT_POOL: PoolSpec(replicas, cfg)}, DEFAULT_POOL)


def load_pools(path: str | Path) -> PoolFile:
    """Read and check a pool file; ``config`` paths become absolute (relative to the file)."""
    p = Path(path).expanduser().resolve()
    try:
        raw = msgspec.yaml.decode(p.read_bytes(), type=PoolFile)
    except OSError as e:
        raise ConfigError(f"{p}: {e.strerror or e}") from None
    except msgspec.ValidationError as e:
        raise ConfigError(f"{p}: {e}") from None
    except msgspec.DecodeError as e:
        raise ConfigError(f"{p}: not valid YAML: {e}") from None
    if not raw.pools:
        raise ConfigError(f"{p}: pools: at least one pool is needed")
    pools = {}
    for name, spec in raw.pools.items():
        if not _NAME.match(name):
            raise ConfigError(f"{p}: pools.{name}: a pool name is lower-case letters, digits, "
                              "'-' or '_' (it names an HAProxy backend and a header value)")
        if spec.devices is not None and len(spec.devices) != spec.replicas:
            raise ConfigError(f"{p}: pools.{name}.devices: {len(spec.devices)} boards for "
                              f"{spec.replicas} replicas")
        cfg = str((p.parent / spec.config).resolve()) if spec.config else None
        if cfg is not None and not Path(cfg).is_file():
            raise ConfigError(f"{p}: pools.{name}.config: {cfg} does not exist")
        pools[name] = PoolSpec(spec.replicas, cfg, spec.devices)
    default = raw.default_pool or ("throughput" if "throughput" in pools else next(iter(pools)))
    if default not in pools:
        raise ConfigError(f"{p}: default_pool: {default!r} is not one of the pools "
                          f"({', '.join(pools)})")
    return PoolFile(pools, default)


def plan_replicas(pools: PoolFile, ports: list[int]) -> list[Replica]:
    """Every replica with its board and its port (``ports``: one per replica, in order)."""
    out: list[Replica] = []
    next_dev = 0
    used: set[int] = set()
    for name, spec in pools.pools.items():
        for i in range(spec.replicas):
            if spec.devices is not None:
                dev = spec.devices[i]
            else:
                while next_dev in used:
                    next_dev += 1
                dev = next_dev
            if dev in used:
                raise ConfigError(f"pools.{name}: board {dev} is given to two replicas "
                                  "(one process per board)")
            used.add(dev)
            out.append(Replica(name, i, dev, 0, spec.config))
    if len(ports) != len(out):
        raise ValueError(f"{len(ports)} ports for {len(out)} replicas")
    return [Replica(r.pool, r.index, r.device, port, r.config) for r, port in zip(out, ports)]


def template_path() -> Path:
    """``deploy/haproxy/haproxy.cfg`` of this checkout."""
    return Path(__file__).resolve().parent.parent / "deploy" / "haproxy" / "haproxy.cfg"


def _hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def render_haproxy(template: str, pools: PoolFile, replicas: list[Replica], *, bind_host: str,
                   port: int, stats_port: int, check_inter_ms: int = 1000, check_fall: int = 1,
                   check_rise: int = 2, hard_stop_after_s: int = 120, maxconn: int = 4096) -> str:
    """The haproxy.cfg for ``replicas`` (template syntax: the template's header comment)."""
    lines = template.splitlines()
    try:
        begin = lines.index("#@pool-begin")
        end = lines.index("#@pool-end")
    except ValueError:
        raise ConfigError("haproxy template: no #@pool-begin / #@pool-end block") from None
    block = lines[begin + 1:end]
    rendered: list[str] = []
    for name in pools.pools:
        for line in block:
            if line.rstrip().endswith("#@server"):
                tmpl = string.Template(line.rstrip()[:-len("#@server")].rstrip())
                for r in replicas:
                    if r.pool == name:
                        rendered.append(tmpl.substitute(
                            server=f"{r.name}-dev{r.device}",
                            address=_hostport("127.0.0.1", r.port), pool=name))
            else:
                rendered.append(string.Template(line).safe_substitute(pool=name))
        rendered.append("")
    rules = []
    for name in pools.pools:
        rules.append(f"    acl pool_is_{name} req.hdr({POOL_HEADER}) -i {name}")
        rules.append(f"    use_backend pool_{name} if pool_is_{name}")
    values = dict(
        bind=_hostport(bind_host, port), stats_bind=_hostport("127.0.0.1", stats_port),
        pool_rules="\n".join(rules), default_pool=pools.default_pool or DEFAULT_POOL,
        check_inter_ms=check_inter_ms, check_fall=check_fall, check_rise=check_rise,
        hard_stop_after_s=hard_stop_after_s, maxconn=maxconn,
    )
    out = []
    for line in lines[:begin] + rendered + lines[end + 1:]:
        t = string.Template(line)
        # comments may name placeholders in prose; configuration lines must fill every one
        out.append(t.safe_substitute(values) if line.lstrip().startswith("#") else
                   t.substitute(values))
    return "\n".join(out) + "\n"
