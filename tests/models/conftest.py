"""Fixtures of the model-package tests: the demo package is built ONCE per session into an isolated
home; tests that tamper get their own copy inside their own trusted model root."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from calserve.config import TrustConfig
from calserve.models.signing import TrustStore, dev_key, sign_package


@pytest.fixture(scope="session")
def demo_home(new_demo_home: Callable[[str], Path]) -> Path:
    return new_demo_home("calserve-home")


@pytest.fixture(scope="session")
def demo_pkg(demo_home: Path) -> Path:
    return demo_home / "models" / "demo-qwen3"


@pytest.fixture(scope="session")
def dev_trust(demo_home: Path) -> TrustStore:
    return TrustStore.from_config(TrustConfig(), home=demo_home)


@pytest.fixture
def model_root(tmp_path: Path) -> Path:
    root = tmp_path / "models"
    root.mkdir()
    return root


@pytest.fixture
def pkg_copy(demo_pkg: Path, model_root: Path) -> Path:
    """A private copy of the signed demo package inside ``model_root``."""
    dst = model_root / "demo"
    shutil.copytree(demo_pkg, dst)
    return dst


@pytest.fixture
def resign(demo_home: Path) -> Callable[[Path], None]:
    """Re-sign a package with the trusted dev key (to reach the validator past the hash check)."""
    key = dev_key(demo_home)
    return lambda pkg: (sign_package(pkg, key), None)[1]


@pytest.fixture
def edit_manifest(resign: Callable[[Path], None]) -> Callable[[Path, Callable[[dict[str, Any]], None]], None]:
    def edit(pkg: Path, fn: Callable[[dict[str, Any]], None]) -> None:
        m = json.loads((pkg / "manifest.json").read_text())
        fn(m)
        (pkg / "manifest.json").write_text(json.dumps(m, indent=2))
        resign(pkg)

    return edit
