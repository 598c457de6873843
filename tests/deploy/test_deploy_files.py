"""deploy/ stays valid and agrees with the server's configuration: the rendered haproxy.cfg passes
``haproxy -c``, the pools' configs decode and say what deploy/README.md says, the systemd unit and
the Kubernetes manifests stop slower than the drain, and probe/port the server's routes."""

from __future__ import annotations

import configparser
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import msgspec
import pytest
import yaml

from calserve.cluster_config import (load_pools, plan_replicas, render_haproxy, single_pool,
                                     template_path)
from calserve.config import decode_config, load_config
from calserve.errors import ConfigError

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def _haproxy() -> str:
    exe = shutil.which("haproxy")
    assert exe is not None, "haproxy is required (apt-get install haproxy; .ci/run installs it)"
    return exe


def _render(pools: Any, n: int) -> str:
    replicas = plan_replicas(pools, [20000 + i for i in range(n)])
    return render_haproxy(template_path().read_text(), pools, replicas, bind_host="127.0.0.1",
                          port=18000, stats_port=18404)


@pytest.mark.parametrize("which", ["single", "pools"])
def test_rendered_haproxy_cfg_is_valid(tmp_path: Path, which: str) -> None:
    if which == "single":
        pools, n = single_pool(3, None), 3
    else:
        pools = load_pools(DEPLOY / "pools" / "pools.yaml")
        n = sum(p.replicas for p in pools.pools.values())
    rendered = _render(pools, n)
    cfg = tmp_path / "haproxy.cfg"
    cfg.write_text(rendered)
    r = subprocess.run([_haproxy(), "-c", "-f", str(cfg)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    text = "\n".join(ln for ln in rendered.splitlines() if not ln.lstrip().startswith("#"))
    assert "$" not in text
    # what the issue and deploy/README.md promise
    assert "balance leastconn" in text and "option httpchk GET /ready" in text
    assert "http-check expect status 200" in text
    assert re.search(r"retry-on conn-failure empty-response", text)
    assert "option redispatch" in text and "timeout tunnel 1h" in text
    assert "timeout server 1h" in text and "on-marked-down" not in text
    assert "http-buffer-request" not in text and "compression" not in text
    assert "bind 127.0.0.1:18404" in text and "stats enable" in text
    servers = re.findall(r"^\s+server (\S+) 127\.0\.0\.1:(\d+)$", text, re.M)
    assert sorted(int(p) for _, p in servers) == [20000 + i for i in range(n)]
    if which == "pools":
        assert "default_backend pool_throughput" in text
        assert "acl pool_is_latency req.hdr(X-Calserve-Pool) -i latency" in text
        assert "use_backend pool_latency if pool_is_latency" in text


def test_pool_file_and_pool_configs() -> None:
    pools = load_pools(DEPLOY / "pools" / "pools.yaml")
    assert pools.default_pool == "throughput" and set(pools.pools) == {"latency", "throughput"}
    lat = load_config(pools.pools["latency"].config)
    thr = load_config(pools.pools["throughput"].config)
    assert lat.scheduler.batch.profiles == [1] and lat.scheduler.batch.instance_pool == 1
    assert lat.scheduler.executor.max_inflight == 1 and lat.runtime.profile == "calrt-0.7.6"
    assert thr.scheduler.batch.instance_pool == 16 and thr.scheduler.executor.max_inflight == 2
    assert thr.runtime.profile == "sim-next"  # B16 is C3: the software runtime only
    assert "C3" in (DEPLOY / "pools" / "throughput.yaml").read_text()
    replicas = plan_replicas(pools, [1, 2, 3])
    assert [(r.pool, r.device) for r in replicas] == [("latency", 0), ("throughput", 1),
                                                      ("throughput", 2)]


def test_pool_file_errors_name_the_key(tmp_path: Path) -> None:
    bad = tmp_path / "p.yaml"
    bad.write_text("pools: {Latency: {replicas: 1}}\n")
    with pytest.raises(ConfigError, match="pools.Latency"):
        load_pools(bad)
    bad.write_text("pools: {a: {replicas: 2, devices: [1]}}\n")
    with pytest.raises(ConfigError, match="devices"):
        load_pools(bad)
    bad.write_text("pools: {a: {replicas: 1, devices: [3]}, b: {replicas: 1, devices: [3]}}\n")
    with pytest.raises(ConfigError, match="board 3"):
        plan_replicas(load_pools(bad), [1, 2])
    bad.write_text("pools: {a: {replicas: 1}}\ndefault_pool: b\n")
    with pytest.raises(ConfigError, match="default_pool"):
        load_pools(bad)
    bad.write_text("pools: {a: {replicas: 0}}\n")
    with pytest.raises(ConfigError, match="replicas"):
        load_pools(bad)


def test_systemd_unit_stops_slower_than_the_drain() -> None:
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str  # type: ignore[assignment,method-assign]
    unit.read(DEPLOY / "systemd" / "calserve@.service")
    svc = unit["Service"]
    assert svc["Restart"] == "always" and svc["KillSignal"] == "SIGTERM"
    start = svc["ExecStart"]
    assert "exec " in start and " serve " in start and "--device %i" in start
    for name in ("latency.yaml", "throughput.yaml"):
        drain = load_config(DEPLOY / "pools" / name).server.drain_timeout_s
        assert float(svc["TimeoutStopSec"]) > drain + 5
    m = re.search(r"CALSERVE_PORT_BASE=(\d+)", (DEPLOY / "systemd" / "calserve@.service").read_text())
    assert m is not None and "$((CALSERVE_PORT_BASE + %i))" in start
    base = int(m.group(1))
    prom = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in prom["scrape_configs"]}
    targets = jobs["calserve-systemd"]["static_configs"][0]["targets"]
    assert targets == [f"127.0.0.1:{base + i}" for i in range(4)]
    assert all(j.get("metrics_path", "/metrics") == "/metrics" for j in jobs.values())
    assert jobs["haproxy"]["static_configs"][0]["targets"] == ["127.0.0.1:8404"]
    # the cluster's default stats port is the one Prometheus scrapes
    from calserve.cluster import build_parser
    args = build_parser().parse_args(["--replicas", "1", "--port", "1", "--run-dir", "x"])
    assert args.stats_port == 8404


def _docs() -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((DEPLOY / "kubernetes" / "calserve.yaml").read_text()) if d]


def test_kubernetes_manifests_match_the_server() -> None:
    docs = _docs()
    cm = next(d for d in docs if d["kind"] == "ConfigMap")
    deployments = [d for d in docs if d["kind"] == "Deployment"]
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    assert {d["metadata"]["labels"]["pool"] for d in deployments} == {"latency", "throughput"}
    for dep in deployments:
        pod = dep["spec"]["template"]["spec"]
        (c,) = pod["containers"]
        cfg_name = c["args"][c["args"].index("--config") + 1].rsplit("/", 1)[1]
        cfg = decode_config(yaml.safe_load(cm["data"][cfg_name]), cfg_name)
        assert c["args"][0] == "serve" and c["args"][c["args"].index("--device") + 1] == "0"
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert ports["http"] == cfg.server.port and cfg.server.host == "0.0.0.0"
        rp, lp = c["readinessProbe"]["httpGet"], c["livenessProbe"]["httpGet"]
        assert rp["path"] == "/ready" and lp["path"] == "/health"
        assert ports.get(rp["port"], rp["port"]) == cfg.server.port
        assert ports.get(lp["port"], lp["port"]) == cfg.server.port
        sleep = int(c["lifecycle"]["preStop"]["exec"]["command"][-1])
        assert pod["terminationGracePeriodSeconds"] > sleep + cfg.server.drain_timeout_s
        assert c["resources"]["limits"] == {"calculet.io/board": 1}
        ann = dep["spec"]["template"]["metadata"]["annotations"]
        assert int(ann["prometheus.io/port"]) == cfg.server.port
        svc = services[dep["metadata"]["name"]]
        assert svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]
        assert svc["spec"]["ports"][0]["targetPort"] in ("http", cfg.server.port)
        if dep["metadata"]["labels"]["pool"] == "throughput":
            assert cfg.runtime.profile == "sim-next" and cfg.scheduler.batch.instance_pool == 16
        else:
            assert cfg.scheduler.executor.max_inflight == 1


def test_pool_yaml_decodes_strictly() -> None:
    for name in ("latency.yaml", "throughput.yaml"):
        msgspec.yaml.decode((DEPLOY / "pools" / name).read_bytes())  # plain YAML
        load_config(DEPLOY / "pools" / name)  # and a valid calserve config
