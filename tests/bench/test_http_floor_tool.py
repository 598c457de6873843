"""bench/http_floor.py finds its profiler in the interpreter's own bin/ when PATH does not have it
(a virtualenv run as ``.venv/bin/python -m bench.http_floor``)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from bench.http_floor import _tool


def test_a_tool_beside_the_interpreter_is_found_without_path(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    bindir = tmp_path / "venv" / "bin"
    bindir.mkdir(parents=True)
    (bindir / "py-spy").write_text("#!/bin/sh\n")
    (bindir / "py-spy").chmod(0o755)
    (bindir / "not-executable").write_text("")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setattr(sys, "executable", str(bindir / "python"))
    assert _tool("py-spy") == str(bindir / "py-spy")
    assert _tool("not-executable") is None
    assert _tool("absent-tool") is None


def test_path_comes_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    on_path = tmp_path / "path"
    on_path.mkdir()
    (on_path / "py-spy").write_text("#!/bin/sh\n")
    (on_path / "py-spy").chmod(0o755)
    monkeypatch.setenv("PATH", str(on_path) + os.pathsep + os.environ.get("PATH", ""))
    assert _tool("py-spy") == str(on_path / "py-spy")
