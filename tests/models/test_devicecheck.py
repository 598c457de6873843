"""device-check: the spec §18 matrix passes on both runtime profiles with N/A rows for what
calrt-0.7.6 lacks. Runs on the software CalRT when it is built, and on a numpy stand-in always (so
the matrix logic itself is tested), including a runtime bug device-check must catch."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest

from calserve.cli import main
from calserve.models.devicecheck import CHECKS, print_table, run_device_check
from calserve.models.package import VerifiedPackage, open_package
from calserve.models.signing import TrustStore

from .fake_runtime import FakeCalbin, FakeDevice


@pytest.fixture(scope="module")
def vp(demo_pkg: Path, dev_trust: TrustStore) -> VerifiedPackage:
    return open_package(demo_pkg, dev_trust, demo_pkg.parent)


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> None:
    import calserve.runtime

    monkeypatch.setattr(calserve.runtime, "Device", FakeDevice, raising=False)


def _table(rows: list) -> dict[tuple[str, str], str]:  # type: ignore[type-arg]
    return {(r.check, r.profile): r.status for r in rows}


def test_matrix_on_stand_in_both_runtimes(vp: VerifiedPackage, fake: None) -> None:
    old = _table(run_device_check(vp, "calrt-0.7.6", soak_cycles=3))
    assert all(old[(c, "B1")] in ("PASS", "N/A") for c in CHECKS)
    assert old[("lanes 1..B filled", "B1")] == "N/A" and old[("single seq prefill+decode", "B1")] == "PASS"
    assert all(old[(c, f"B{b}")] == "N/A" for c in CHECKS for b in (4, 8, 16))
    new = _table(run_device_check(vp, "sim-next", soak_cycles=3))
    assert all(new[(c, f"B{b}")] == "PASS" for c in CHECKS for b in (4, 8, 16)), new


def test_matrix_catches_a_runtime_that_writes_kv_on_inactive_lanes(
    vp: VerifiedPackage, fake: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = FakeCalbin.submit_decode

    def leaky(self, seq_ids, tokens, positions, valid, engine=0):  # type: ignore[no-untyped-def]
        for s, t, v in zip(seq_ids, tokens, valid):
            if not v and self.seqs.get(s) is not None:
                self.seqs[s].k_cache[0] = self.seqs[s].k_cache[0] + np.float32(1.0)
        return real(self, seq_ids, tokens, positions, valid, engine)

    monkeypatch.setattr(FakeCalbin, "submit_decode", leaky)
    rows = run_device_check(vp, "sim-next", soak_cycles=1)
    t = _table(rows)
    assert t[("inactive lanes no KV write", "B4")] == "FAIL"
    out = io.StringIO()
    print_table(rows, out)
    assert "FAIL" in out.getvalue()


def test_cli_device_check_exit_codes(
    demo_home: Path, demo_pkg: Path, fake: None, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("CALSERVE_HOME", str(demo_home))
    assert main(["device-check", str(demo_pkg), "--soak", "2"]) == 0
    out = capsys.readouterr().out
    assert "N/A" in out and "FAIL" not in out.replace("0 FAIL", "")
    assert main(["device-check", str(demo_pkg), "--runtime", "sim-next", "--soak", "2"]) == 0


@pytest.mark.parametrize("runtime", ["calrt-0.7.6", "sim-next"])
def test_matrix_on_software_calrt(vp: VerifiedPackage, runtime: str) -> None:
    pytest.importorskip("calserve._calrt", reason="software CalRT not built")
    rows = run_device_check(vp, runtime, soak_cycles=5)
    bad = [r for r in rows if r.status == "FAIL"]
    assert not bad, bad
    assert any(r.status == "N/A" for r in rows)  # B1 has N/A rows on both runtimes
