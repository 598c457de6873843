"""The demo package: built once, atomically, by racing builders; deterministic; signed by the dev key."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from calserve.config import TrustConfig
from calserve.models.demo import DEMO_NAME, ensure_demo_package
from calserve.models.package import open_package
from calserve.models.signing import TrustStore


def test_parallel_builders_agree(tmp_path: Path) -> None:
    home = tmp_path / "home"
    code = "import sys; from calserve.models.demo import ensure_demo_package; print(ensure_demo_package(sys.argv[1]))"
    t0 = time.monotonic()
    procs = [
        subprocess.Popen([sys.executable, "-c", code, str(home)], stdout=subprocess.PIPE, text=True)
        for _ in range(3)
    ]
    outs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert len(set(outs)) == 1 and Path(outs[0]) == home / "models" / DEMO_NAME
    assert time.monotonic() - t0 < 60  # "building takes seconds" (3 cold interpreters included)
    # One key, one package, no leftovers of the losers.
    assert sorted(p.name for p in (home / "models").iterdir()) == [DEMO_NAME]
    assert sorted(p.name for p in (home / "keys").iterdir()) == ["dev"]
    trust = TrustStore.from_config(TrustConfig(), home=home)
    vp = open_package(DEMO_NAME, trust, home / "models")
    assert ensure_demo_package(home) == vp.path  # a second call reuses it


def test_demo_is_deterministic(demo_pkg: Path, tmp_path: Path) -> None:
    other = ensure_demo_package(tmp_path / "h2")
    for f in ("manifest.json", "model.safetensors", "tokenizer.json", "golden.json", "SHA256SUMS"):
        assert (other / f).read_bytes() == (demo_pkg / f).read_bytes(), f
