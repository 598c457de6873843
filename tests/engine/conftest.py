"""Fixtures for the engine tests that use the software runtime and the demo package.

One VirtualDevice per process: every test opens and closes it through ``Engine.open`` (which owns
the device when no backend is injected); pytest runs them one after the other."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from calserve.config import TrustConfig
from calserve.models.source import ModelSource, source_from_package
from calserve.models.package import open_package
from calserve.models.signing import TrustStore


@pytest.fixture(scope="session")
def engine_home(new_demo_home: Callable[[str], Path]) -> Path:
    return new_demo_home("calserve-engine-home")


@pytest.fixture(scope="session")
def demo_source(engine_home: Path) -> ModelSource:
    trust = TrustStore.from_config(TrustConfig(), home=engine_home)
    pkg = open_package(engine_home / "models" / "demo-qwen3", trust, engine_home / "models")
    return source_from_package(pkg, "qwen3")
