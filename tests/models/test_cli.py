"""The ``calserve`` CLI in an isolated CALSERVE_HOME: pack --demo + verify with no flags, keygen,
untrusted keys, and one-line errors with no traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from calserve.cli import main


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    h = tmp_path / "home"
    monkeypatch.setenv("CALSERVE_HOME", str(h))
    monkeypatch.delenv("CALSERVE_CONFIG", raising=False)
    return h


def test_pack_demo_then_verify_without_flags(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = home / "models" / "demo"
    assert main(["pack", "--demo", "--out", str(out)]) == 0
    assert (home / "keys" / "dev" / "dev.pub").exists()  # the development key, created on first use
    capsys.readouterr()
    assert main(["verify", str(out)]) == 0
    text = capsys.readouterr().out
    assert text.startswith("OK ") and "B1 (C0, runnable on calrt-0.7.6)" in text
    assert "B16 (C3, unavailable on calrt-0.7.6)" in text
    assert main(["verify", str(out), "--runtime", "sim-next"]) == 0
    assert "B16 (C3, runnable on sim-next)" in capsys.readouterr().out


def test_keygen_pack_with_key_and_trusted_key(
    home: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    key = tmp_path / "k" / "vendor"
    assert main(["keygen", "--out", str(key)]) == 0
    assert key.exists() and Path(str(key) + ".pub").exists()
    assert main(["keygen", "--out", str(key)]) == 1  # never overwrites a key
    out = tmp_path / "pkg"
    assert main(["pack", "--demo", "--out", str(out), "--key", str(key), "--profiles", "1,4", "--timing", "sat-4k"]) == 0
    capsys.readouterr()
    assert main(["verify", str(out)]) == 1  # signed by a key nobody trusts
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "untrusted key" in err and "Traceback" not in err
    assert main(["verify", str(out), "--trusted-key", str(key) + ".pub"]) == 0
    assert "timing     sat-4k" in capsys.readouterr().out
    # An existing package is not replaced without --force.
    assert main(["pack", "--demo", "--out", str(out), "--key", str(key)]) == 1
    assert "already exists" in capsys.readouterr().err
    assert main(["pack", "--demo", "--out", str(out), "--key", str(key), "--force"]) == 0


def test_cli_errors_are_one_line(home: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", str(tmp_path / "missing")]) == 1
    assert main(["pack", "--demo", "--out", str(tmp_path / "p"), "--timing", "warp"]) == 1
    cfg = tmp_path / "c.yaml"
    cfg.write_text("scheduler:\n  nope: 1\n")
    assert main(["verify", str(tmp_path / "p"), "--config", str(cfg)]) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 3 and all(line.startswith("calserve ") for line in err)
    assert "no such package" in err[0] and "unknown timing profile 'warp'" in err[1]
    assert "nope" in err[2]
    with pytest.raises(SystemExit) as e:
        main(["pack", "--demo", "--out", "x", "--profiles", "3"])
    assert e.value.code == 2
