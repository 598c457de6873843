"""E2E fixtures: the demo package is built ONCE per session into an isolated CALSERVE_HOME
(``ensure_demo_package`` builds in a temporary directory and renames atomically), then real
``hypercorn -k trio calserve:app`` processes serve it on 127.0.0.1."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from .server import ServerProcess, serving


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/e2e/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.e2e)


@pytest.fixture(scope="session")
def calserve_home(new_demo_home: Callable[[str], Path]) -> Path:
    return new_demo_home("calserve-home")


@pytest.fixture(scope="session")
def server(calserve_home: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The embedded default (no config): software runtime + demo package, alias ``qwen3``."""
    with serving(calserve_home, tmp_path_factory.mktemp("cwd")) as proc:
        yield proc


@pytest.fixture(autouse=True)
def _collect_leaked_sockets() -> Iterator[None]:
    """A socket (or client) a test forgot to close is reported by its finalizer, whenever the
    garbage collector gets to it: collect at each e2e test's end so the ResourceWarning (an error
    here) names the test that leaked it, not a later one."""
    yield
    import gc
    gc.collect()
