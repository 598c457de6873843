"""``bench.multi_step_ttft``: the three servers differ only in how decode jobs take their steps, on
a timing the benchmark server registers; the table reads the medians."""

from __future__ import annotations

from pathlib import Path

from bench.multi_step_ttft import VARIANTS, _write_table, variant_config
from bench.serve_entry import KNEE_STEPS_US, STEP_PREFIX
from calserve.config import decode_config


def test_the_variants_differ_only_in_their_steps() -> None:
    cfgs = {name: variant_config(name, 4000, 8) for name in VARIANTS}
    one, dev, host = (cfgs[n] for n in VARIANTS)
    assert "multi_step" not in one["scheduler"]["batch"]
    assert dev["scheduler"]["batch"]["multi_step"] == host["scheduler"]["batch"]["multi_step"] == 8
    assert "host_multi_step" not in dev["runtime"] and host["runtime"]["host_multi_step"] is True
    assert {**host["runtime"], "host_multi_step": False} == {**dev["runtime"], "host_multi_step": False}
    for cfg in cfgs.values():
        assert [m["timing"] for m in cfg["models"].values()] == [f"{STEP_PREFIX}4000"]
        assert cfg["scheduler"]["batch"]["profiles"] == [16]
        decode_config(cfg)  # a valid configuration
    assert 4000 in KNEE_STEPS_US


def test_the_table(tmp_path: Path) -> None:
    row = {"ttft_p50_ms": 10.0, "ttft_p99_ms": 50.0, "tpot_p50_ms": 8.0, "tpot_p99_ms": 9.0,
           "itl_p99_ms": None, "output_tok_s": 2600.0, "runs_stopped": 0.0, "steps_cut": 0.0,
           "steps_per_job": 6.5}
    doc = {"step_us": 4000, "multi_step": 8, "rate_req_s": 17.6, "load": 0.6, "bound_tok_s": 3757.0,
           "prompt": "16", "output": "128", "rounds": 2, "by_variant": {n: row for n in VARIANTS}}
    _write_table(tmp_path / "t.md", doc)
    text = (tmp_path / "t.md").read_text()
    assert "| host_multi_step | 10.0 | 50.0 | 8.00 | 9.00 | – | – | – | – | 2600 | 6.50 | 0 | 0 |" in text
    assert "4 ms step, max_inflight 2, multi_step 8" in text and "EOS" not in text
    # --eos: requests end on their EOS; the end-to-end latency and the tokens a request beside
    row = {**row, "e2e_p50_ms": 300.0, "e2e_p99_ms": 900.0, "tokens_per_request": 41.5}
    _write_table(tmp_path / "e.md", {**doc, "eos": True, "by_variant": {n: row for n in VARIANTS}})
    text = (tmp_path / "e.md").read_text()
    assert "| host_multi_step | 10.0 | 50.0 | 8.00 | 9.00 | – | 300.0 | 900.0 | 41.5 | 2600 | 6.50 | 0 | 0 |" in text
    assert "output 128 (ends on EOS, a cap)" in text


def test_one_engine() -> None:
    assert variant_config("host_multi_step", 4000, 8, max_inflight=1)["scheduler"]["executor"]["max_inflight"] == 1
    assert variant_config("one_step", 4000, 8)["scheduler"]["executor"]["max_inflight"] == 2
