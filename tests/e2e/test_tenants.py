"""Tenants from config on a real server: API key -> tenant, unknown key 401, tenant quota 429."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from .server import ServerProcess, scrape, serving, value


@pytest.fixture(scope="module")
def tenant_server(calserve_home: Path, tmp_path_factory: pytest.TempPathFactory
                  ) -> Iterator[ServerProcess]:
    config_yaml = (
        "tenants:\n"
        "  alice: {api_keys: [key-alice], weight: 2.0}\n"
        "  bob: {api_keys: [key-bob], qps: 0.001, burst: 1}\n"
    )
    with serving(calserve_home, tmp_path_factory.mktemp("tenants"), config_yaml) as proc:
        yield proc


def test_keys_map_to_tenants_and_quota(tenant_server: ServerProcess) -> None:
    url = tenant_server.url
    body = {"prompt": "hi", "max_tokens": 3, "ignore_eos": True}
    r = httpx.post(url + "/v1/completions", json=body)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.post(url + "/v1/completions", json=body, headers={"Authorization": "Bearer nope"})
    assert r.status_code == 401
    r = httpx.post(url + "/v1/completions", json=body,
                   headers={"Authorization": "Bearer key-alice"}, timeout=60)
    assert r.status_code == 200
    bob = {"Authorization": "Bearer key-bob"}
    assert httpx.post(url + "/v1/completions", json=body, headers=bob, timeout=60).status_code == 200
    r = httpx.post(url + "/v1/completions", json=body, headers=bob, timeout=60)
    assert r.status_code == 429, r.text  # bob's token bucket (burst 1, ~no refill) is empty
    assert int(r.headers["Retry-After"]) >= 1
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    m = scrape(url)
    assert value(m, "calserve_tenant_service_tokens_total", tenant="alice") > 0
    assert value(m, "calserve_tenant_service_tokens_total", tenant="bob") > 0
    assert value(m, "calserve_completion_tokens_total", alias="qwen3", tenant="alice") == 3
