"""``bench.runtime_bench``'s box line: what a decode step multiplies, and the B16 / B1 ratio as the
box's multiply-add rate over its weight bandwidth (issue 17's figure, read against the hardware)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from bench.runtime_bench import CFG, box_line, matmul_weights, paired_line, paired_ratios, with_sampler
from calserve.runtime.reference import random_weights


def test_tied_head_is_the_embedding() -> None:
    w = random_weights(CFG, seed=0)
    assert "lm_head.weight" not in w
    assert matmul_weights(w) == sum(a.size for a in w.values() if a.ndim == 2)


def test_untied_embedding_is_only_looked_up() -> None:
    w = {"model.embed_tokens.weight": np.zeros((100, 8), np.float32),
         "lm_head.weight": np.zeros((100, 8), np.float32),
         "model.layers.0.mlp.down_proj.weight": np.zeros((8, 16), np.float32),
         "model.norm.weight": np.zeros(8, np.float32)}
    assert matmul_weights(w) == 100 * 8 + 8 * 16


@pytest.mark.parametrize("t1, t16", [(0.0125, 0.025), (0.018, 0.029), (0.020, 0.040)])
def test_ratio_is_sixteen_b1_steps_over_one_b16_step(t1: float, t16: float) -> None:
    macs = 134_479_872
    line = box_line(macs, 4 * macs, t1, t16)
    ratio = float(re.search(r"= ([\d.]+)x", line).group(1))  # type: ignore[union-attr]
    assert ratio == pytest.approx(16 * t1 / t16, abs=0.05)
    bw = float(re.search(r"streams ([\d.]+) GB/s", line).group(1))  # type: ignore[union-attr]
    assert bw == pytest.approx(4 * macs / t1 / 1e9, abs=0.05)
    limit = float(re.search(r"<= ([\d.]+) GB/s", line).group(1))  # type: ignore[union-attr]
    # at the bandwidth limit, 16 B1 steps take exactly 8 B16 steps
    assert 16 * (4 * macs / (limit * 1e9)) / t16 == pytest.approx(8.0, rel=0.01)


def test_sampler_costs_add_to_each_step() -> None:
    """``--sampler``: a feature's sampling follows its step (one job in flight); no cost leaves
    the kernels' figures as they are, a cost lowers both rates and moves the ratio toward B16's
    share of it."""
    rows = {"free": {"B1_us_per_step": 0.0, "B16_us_per_step": 0.0},
            "top_p": {"B1_us_per_step": 500.0, "B16_us_per_step": 4_000.0}}
    (free, f1, f16, fr), (name, t1, t16, tr) = with_sampler(0.0125, 0.025, rows)
    assert (free, name) == ("free", "top_p")
    assert (f1, f16, fr) == pytest.approx((80.0, 640.0, 8.0))
    assert t1 == pytest.approx(1 / 0.013)
    assert t16 == pytest.approx(16 / 0.029)
    assert tr == pytest.approx(16 * 0.013 / 0.029)
    assert t1 < f1 and t16 < f16


def test_pairs_run_each_kind_forth_and_back() -> None:
    """``--paired``: each pair runs every kind's step in order, then in reverse order (after one
    warm-up step of each), and reports each kind's mean step."""
    calls: list[str] = []
    times = iter([9.0, 9.0, 9.0] + [0.02, 0.05, 0.08, 0.09, 0.07, 0.04]
                 + [0.03, 0.06, 0.10, 0.12, 0.08, 0.01])

    def kind(name: str) -> Callable[[], float]:
        def step() -> float:
            calls.append(name)
            return next(times)
        return step

    pairs = paired_ratios([kind("b1"), kind("b16"), kind("pp")], 2)
    assert calls == ["b1", "b16", "pp"] + ["b1", "b16", "pp", "pp", "b16", "b1"] * 2
    assert pairs == [pytest.approx([0.03, 0.06, 0.085]), pytest.approx([0.02, 0.07, 0.11])]


def test_paired_line_counts_pairs_at_the_bar() -> None:
    line = paired_line("one job in flight", [8.0, 6.4, 9.6, 12.0])
    assert "one job in flight, 4 pairs" in line
    assert "min 6.40x" in line and "max 12.00x" in line
    assert "median 9.60x" in line  # the upper median of an even count
    assert "3 of 4 pairs >= 8x" in line


def test_runs_as_the_script_it_is_documented_as(tmp_path: Path) -> None:
    """``python bench/runtime_bench.py`` from anywhere, no PYTHONPATH: its ``bench.*`` imports
    (``--sampler``'s ``bench.sampler_cost``) resolve to the repository's bench package."""
    script = Path(__file__).resolve().parents[2] / "bench" / "runtime_bench.py"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([sys.executable, str(script), "--help"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "--sampler" in r.stdout
