"""Shared test configuration.

Hypothesis: the ``ci`` profile (default) is derandomized with a fixed example budget so runs are
reproducible on a loaded 2-core machine; ``--hypothesis-profile=long`` explores more.
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
