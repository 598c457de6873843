"""The ``peer`` scenario's parts that need no llama-server: the table / ratio logic on fake rows, the
GGUF export of a calserve package (read back by calserve's own GGUF importer: same tensors, same
tokenization), the F32 rewrite of a quantized GGUF, the binary lookup order and the message when
there is none."""

from __future__ import annotations

import json
import math
import stat
from pathlib import Path

import gguf
import numpy as np
import pytest
import tokenizers
from gguf import quants

from bench.peer import agreement, run
from bench.peer_gguf import export_package, gguf_to_f32, llamacpp_permute
from bench.peer_llama import PeerUnavailable, find_llama_server, llama_server_argv
from bench.peer_table import aggregate, markdown_table, ratio_rows
from calserve.models.demo import ensure_demo_package
from calserve.models.gguf_import import read_gguf, unpermute_rope_rows
from calserve.models.hf import load_safetensors


def _field(r: gguf.GGUFReader, key: str) -> object:
    f = r.get_field(key)
    assert f is not None, key
    return f.contents()


def _row(arm: str, rep: int, tok_s: float, ttft: float, **kw: float) -> dict[str, object]:
    return {"model": "tiny", "streams": 8, "arm": arm, "rep": rep, "tok_s": tok_s,
            "ttft_p50_ms": ttft, "ttft_p99_ms": 2 * ttft, "tpot_p50_ms": 2.0,
            "cpu_ms_per_token": 0.5, "host_cpu_ms_per_token": 0.3,
            "device_cpu_ms_per_token": 0.2, "failed": 0, **kw}


def test_ratio_rows_average_repeats_and_divide_by_llama() -> None:
    rows = [_row("calserve-sim-next", 0, 900, 10), _row("calserve-sim-next", 1, 1100, 30),
            _row("llama-server", 0, 800, 5), _row("llama-server", 1, 1200, 15, failed=2),
            _row("calserve-default", 0, 400, 100, tpot_p50_ms=math.nan),
            # a point llama-server did not run: no ratio row
            {**_row("calserve-default", 0, 1, 1), "streams": 32}]
    agg = aggregate(rows)
    sim = agg[("tiny", 8, "calserve-sim-next")]
    assert sim["tok_s"] == 1000 and (sim["tok_s_min"], sim["tok_s_max"]) == (900, 1100)
    assert sim["reps"] == 2 and agg[("tiny", 8, "llama-server")]["failed"] == 2
    assert math.isnan(agg[("tiny", 8, "calserve-default")]["tpot_p50_ms"])
    table = ratio_rows(agg)
    assert [(r["calserve"], r["streams"]) for r in table] == [("calserve-default", 8),
                                                              ("calserve-sim-next", 8)]
    d, s = table
    assert s["tok_s_ratio"] == pytest.approx(1.0) and s["meets_target"] is True
    assert s["ttft_p50_ms_ratio"] == pytest.approx(2.0) and s["failed"] == 2
    assert d["tok_s_ratio"] == pytest.approx(0.4) and d["meets_target"] is False
    assert math.isnan(d["tpot_p50_ms_ratio"])
    md = markdown_table(table)
    lines = md.strip().splitlines()
    assert len(lines) == 4 and all(ln.count("|") == lines[0].count("|") for ln in lines)
    # llama-server's 2 failed requests are counted in both rows it is the denominator of
    assert "**1.00×** (2 not ok)" in lines[3] and "**0.40×** (2 not ok)" in lines[2]
    assert "–" in lines[2]


def test_agreement_counts_identical_texts_and_common_prefix() -> None:
    a = agreement(["abcd", "xy", ""], ["abcd", "xz", ""])
    assert a["identical"] == 2 and a["prompts"] == 3
    assert a["common_prefix_fraction"] == pytest.approx((1 + 0.5 + 1) / 3)


def test_demo_package_exports_to_a_gguf_calserve_reads_back_identically(tmp_path: Path) -> None:
    pkg = ensure_demo_package(tmp_path / "home")
    out = export_package(pkg, tmp_path / "demo.gguf")
    r = gguf.GGUFReader(str(out))
    assert _field(r, "general.architecture") == "qwen3"
    assert _field(r, "tokenizer.ggml.pre") == "gpt-2"
    assert "output.weight" not in {t.name for t in r.tensors}  # tied head
    m = read_gguf(out)
    want = load_safetensors(pkg / "model.safetensors")
    assert set(m.weights) == set(want)
    for k, w in want.items():
        np.testing.assert_array_equal(m.weights[k], w, err_msg=k)
    man = json.loads((pkg / "manifest.json").read_text())
    assert m.config.to_dict() == man["model"]
    theirs = tokenizers.Tokenizer.from_str(m.tokenizer.tokenizer_json)
    ours = tokenizers.Tokenizer.from_file(str(pkg / "tokenizer.json"))
    for text in ("The quick brown fox jumps over the lazy dog.", "river stone calm  fast 2048!",
                 "<|im_start|>user hi<|im_end|>", "ünïcödé ☃ text"):
        assert theirs.encode(text).ids == ours.encode(text).ids, text
    assert list(m.tokenizer.eos_token_ids)[:1] == man["special_tokens"]["eos_token_ids"][:1]


def test_llamacpp_permute_is_the_inverse_of_the_importers_unpermute() -> None:
    w = np.arange(4 * 8 * 3, dtype=np.float32).reshape(4 * 8, 3)
    np.testing.assert_array_equal(unpermute_rope_rows(llamacpp_permute(w, 4), 4), w)
    assert not np.array_equal(llamacpp_permute(w, 4), w)


def test_quantized_gguf_rewritten_as_f32_keeps_metadata_and_values(tmp_path: Path) -> None:
    src = tmp_path / "q.gguf"
    rng = np.random.default_rng(0)
    a = rng.standard_normal((8, 64)).astype(np.float32)
    q = quants.quantize(a, gguf.GGMLQuantizationType.Q8_0)
    wr = gguf.GGUFWriter(str(src), "llama")
    wr.add_block_count(1)
    wr.add_file_type(int(gguf.LlamaFileType.MOSTLY_Q8_0))
    wr.add_array("tokenizer.ggml.tokens", ["a", "b"])
    wr.add_string("tokenizer.chat_template", "{{ x }}")
    wr.add_tensor("blk.0.attn_q.weight", q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    wr.add_tensor("output_norm.weight", np.ones(64, np.float32))
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    out = gguf_to_f32(src, tmp_path / "f32.gguf")
    r = gguf.GGUFReader(str(out))
    assert _field(r, "general.architecture") == "llama"
    assert _field(r, "general.file_type") == int(gguf.LlamaFileType.ALL_F32)
    assert _field(r, "llama.block_count") == 1
    assert _field(r, "tokenizer.ggml.tokens") == ["a", "b"]
    assert _field(r, "tokenizer.chat_template") == "{{ x }}"
    t = {x.name: x for x in r.tensors}
    assert all(x.tensor_type == gguf.GGMLQuantizationType.F32 for x in t.values())
    got = np.asarray(t["blk.0.attn_q.weight"].data).reshape(8, 64)
    np.testing.assert_array_equal(got, quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0))
    assert not (tmp_path / "f32.gguf.part").exists()


def _exe(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_llama_server_lookup_order_and_refusals(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "nobin"))
    monkeypatch.delenv("LLAMA_SERVER", raising=False)
    monkeypatch.setenv("CALSERVE_PEER_CACHE", str(tmp_path / "cache"))
    assert find_llama_server() is None
    cached = _exe(tmp_path / "cache" / "bin" / "llama-server")
    assert find_llama_server() == cached.resolve()
    on_path = _exe(tmp_path / "pathbin" / "llama-server")
    monkeypatch.setenv("PATH", str(on_path.parent))
    assert find_llama_server() == on_path.resolve()
    env = _exe(tmp_path / "env" / "llama-server")
    monkeypatch.setenv("LLAMA_SERVER", str(env))
    assert find_llama_server() == env.resolve()
    explicit = _exe(tmp_path / "explicit" / "ls")
    assert find_llama_server(explicit) == explicit.resolve()
    with pytest.raises(PeerUnavailable, match="--llama-server"):
        find_llama_server(tmp_path / "missing")
    monkeypatch.setenv("LLAMA_SERVER", str(tmp_path / "missing"))
    with pytest.raises(PeerUnavailable, match="LLAMA_SERVER"):
        find_llama_server()


def test_scenario_without_a_llama_server_says_how_to_get_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "nobin"))
    monkeypatch.delenv("LLAMA_SERVER", raising=False)
    monkeypatch.setenv("CALSERVE_PEER_CACHE", str(tmp_path / "cache"))
    with pytest.raises(PeerUnavailable, match=r"--llama-server PATH, or --build"):
        run(tmp_path / "out", True)


def test_llama_server_command_line_matches_the_streams() -> None:
    argv = llama_server_argv(Path("/x/llama-server"), Path("/m.gguf"), parallel=32, ctx_per_slot=512,
                             threads=2)
    joined = " ".join(argv)
    assert "--parallel 32" in joined and "-c 16384" in joined and "--cont-batching" in joined
    assert "-t 2" in joined and "-tb 2" in joined and "{port}" in joined


def test_report_from_rows_writes_table_and_figures(tmp_path: Path) -> None:
    from bench.peer import write_report

    rows = [_row("calserve-sim-next", 0, 900, 10), _row("llama-server", 0, 800, 5),
            _row("calserve-default", 0, 400, 100)]
    table = write_report(tmp_path, rows)
    assert [r["calserve"] for r in table] == ["calserve-default", "calserve-sim-next"]
    assert "**1.12×**" in (tmp_path / "peer_table.md").read_text()
    assert (tmp_path / "peer.png").stat().st_size > 0
    assert (tmp_path / "peer_diagnostics.png").stat().st_size > 0
