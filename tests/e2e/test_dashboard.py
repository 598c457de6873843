"""deploy/grafana/calserve.json: every metric its expressions use has a sample line on a live
server under a little load (so no panel is empty for want of a series), and the file is a
well-formed Grafana dashboard."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

import calserve

from .server import ServerProcess

DASHBOARD = Path(calserve.__file__).resolve().parent.parent / "deploy" / "grafana" / "calserve.json"
_NAME = re.compile(r"\b((?:calserve|process|python)_[a-zA-Z0-9_]+)")


def _panels(dash: dict[str, object]) -> list[dict[str, object]]:
    out = []
    for p in dash["panels"]:  # type: ignore[attr-defined]
        out.append(p)
        out.extend(p.get("panels", []))
    return out


def _exprs() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in _panels(dash) for t in p.get("targets", [])]  # type: ignore[attr-defined]


def test_dashboard_is_well_formed() -> None:
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] == "calserve" and dash["title"]
    ids = [p["id"] for p in _panels(dash)]
    assert len(ids) == len(set(ids))
    graphs = [p for p in _panels(dash) if p["type"] != "row"]
    assert len(graphs) >= 10
    for p in graphs:
        assert p["targets"] and p["datasource"]["uid"] == "${datasource}", p["title"]
        for t in p["targets"]:
            assert t["expr"].count("(") == t["expr"].count(")"), t["expr"]
    titles = " ".join(str(p["title"]).lower() for p in graphs)
    for topic in ("outcome", "ttft", "inter-token", "end-to-end", "tokens per second",
                  "batch fill", "queue", "kv sequences by state", "tenant service shares",
                  "faults", "model state"):
        assert topic in titles, topic


def _load(url: str) -> None:
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    for i in range(3):
        client.completions.create(model="qwen3", prompt=f"load {i}", max_tokens=4)
    for _ in client.chat.completions.create(model="qwen3", max_tokens=4, stream=True,
                                            messages=[{"role": "user", "content": "hi"}]):
        pass
    # one refused request (400) for the HTTP outcome series
    assert httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": -1}).status_code == 400


def test_every_dashboard_metric_has_a_sample_line(server: ServerProcess) -> None:
    _load(server.url)
    text = httpx.get(server.url + "/metrics", timeout=30).text
    samples = {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}
    used = {m for e in _exprs() for m in _NAME.findall(e)}
    assert len(used) >= 30
    missing = sorted(used - samples)
    assert not missing, f"dashboard metrics without a sample line: {missing}"
