"""The admin API's gate: 403 without a token configured, 401 for a missing or wrong one (tenant
keys included), 200 with the right one, from the config or the environment."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec
import pytest

from calserve.api.admin import ENV_ADMIN_TOKEN, check_admin
from calserve.api.errors import ApiError

from .conftest import make_config


async def _get(h: Any, headers: dict[str, str]) -> tuple[int, Any]:
    r = await h.client.get("/admin/v1/status", headers=headers)
    return r.status_code, msgspec.json.decode(await r.get_data())


async def test_no_token_configured_is_403_naming_the_key(
        harness_factory: Callable[..., Any], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_ADMIN_TOKEN, raising=False)
    async with harness_factory(make_config()) as h:
        status, body = await _get(h, {"Authorization": "Bearer anything"})
    assert status == 403
    assert body["error"]["param"] == "admin.token" and "admin.token" in body["error"]["message"]


async def test_wrong_missing_and_tenant_tokens_are_401(
        harness_factory: Callable[..., Any], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_ADMIN_TOKEN, raising=False)
    cfg = make_config(admin={"token": "s3cret"},
                      tenants={"a": {"api_keys": ["tenant-key"]}})
    async with harness_factory(cfg) as h:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"},
                        {"Authorization": "Bearer tenant-key"}, {"Authorization": "Bearer "},
                        {"Authorization": "Basic s3cret"}):
            status, body = await _get(h, headers)
            assert status == 401, headers
            assert body["error"]["code"] == "invalid_admin_token"
        status, body = await _get(h, {"Authorization": "Bearer s3cret"})
        assert status == 200 and body["engine"] == "running" and body["models"] == ["qwen3"]
        # The admin token is not a tenant key either.
        r = await h.client.get("/v1/models", headers={"Authorization": "Bearer s3cret"})
        assert r.status_code == 401


async def test_token_from_environment(harness_factory: Callable[..., Any],
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_ADMIN_TOKEN, "from-env")
    async with harness_factory(make_config()) as h:
        assert (await _get(h, {"Authorization": "Bearer from-env"}))[0] == 200
        assert (await _get(h, {"Authorization": "Bearer other"}))[0] == 401


def test_check_admin_pure() -> None:
    check_admin("t", "Bearer t")
    check_admin("t", "bearer   t ")
    for bad in ("", "Bearer", "Bearer tt", "Bearer t2", "t"):
        with pytest.raises(ApiError) as e:
            check_admin("t", bad)
        assert e.value.status == 401
    with pytest.raises(ApiError) as e:
        check_admin(None, "Bearer t")
    assert e.value.status == 403
