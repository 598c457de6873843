"""``calserve pack --from-gguf`` on a small Gemma 2 GGUF written here as llama.cpp's converter
writes one (``general.architecture`` "gemma2": Gemma 3's tensors without the q/k norms, norms as
1 + w, both logit soft-caps in the metadata).

The package's numpy reference and the software runtime must compute what llama.cpp's gemma2 graph
computes (:class:`~tests.models.test_gguf_gemma3.LlamaCppGemma3` reads the architecture from the
file: every other layer sliding, one RoPE base, each score ``c * tanh(kq / c)`` before the mask,
the output logits capped the same way), on prompts three times the window. The caps of the main
fixture are tight (2 and 3) so that they matter (checked: without them the logits differ);
llama.cpp's defaults for a file without the keys (50, 30, a 4,096 window, pattern 2) and the 27B's
score scale are checked on the config.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from calserve.errors import ValidationError
from calserve.models.gguf_import import read_gguf

from .test_gguf_gemma3 import (PROMPT, LlamaCppGemma3, pack_gemma3, reference_matches_llamacpp,
                               runtime_equals_llamacpp, write_gemma3_gguf)

TIGHT = {"gemma2.attn_logit_softcapping": 2.0, "gemma2.final_logit_softcapping": 3.0}


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    return pack_gemma3(tmp_path_factory.mktemp("gemma2"), arch="gemma2", meta=TIGHT, seed=3)


def test_config_is_what_llamacpp_reads(packed: tuple[Path, Any]) -> None:
    _, vp = packed
    cfg = vp.manifest.model_config()
    assert cfg.architecture == "Gemma2ForCausalLM" and cfg.gemma and not cfg.qk_norm
    assert (cfg.attn_logit_softcapping, cfg.final_logit_softcapping) == (2.0, 3.0)
    assert vp.manifest.model.final_logit_softcapping == 3.0
    assert (cfg.sliding_window, cfg.sliding_window_pattern, cfg.rope_local_theta) == (4, 2, 0.0)
    assert cfg.rope_theta == 10_000.0 and cfg.query_pre_attn_scalar == 32.0
    assert [cfg.sliding(i) for i in range(7)] == [True, False] * 3 + [True]
    assert not any(".q_norm." in n or ".k_norm." in n for n in vp.weights())


def test_reference_computes_what_llamacpp_computes(packed: tuple[Path, Any]) -> None:
    """Greedy tokens equal and logprobs within 1e-3 of llama.cpp's gemma2 graph; the caps and
    the window matter here."""
    path, vp = packed
    want = reference_matches_llamacpp(path, vp.manifest.model_config(), vp.weights(), PROMPT)
    for other in (LlamaCppGemma3(path, softcap=False), LlamaCppGemma3(path, window=False)):
        assert np.abs(other.greedy(PROMPT, 1)[2][-1] - want[-1]).max() > 1e-2
    assert np.abs(want[-1]).max() < 3.0  # the final cap bounds every logit


def test_software_runtime_computes_the_same(packed: tuple[Path, Any]) -> None:
    """calrt-sim against llama.cpp's gemma2 graph: prefill past the window, then decode steps."""
    runtime_equals_llamacpp(*packed, PROMPT)


def test_llamacpp_defaults_for_absent_keys(tmp_path: Path) -> None:
    """No window or cap keys: llama.cpp's 4,096, 50 and 30; the 27B (46 blocks) scales scores by
    1/sqrt(hidden / heads); a sliding_window_pattern key overrides every-other-layer."""
    meta = {"gemma2.attn_logit_softcapping": None, "gemma2.final_logit_softcapping": None,
            "gemma2.attention.sliding_window": None}
    dims = {"hidden": 32, "ff": 16, "layers": 46, "heads": 2, "kv": 1, "head_dim": 8}
    write_gemma3_gguf(tmp_path / "g.gguf", dims, arch="gemma2", meta=meta, f16=False)
    cfg = read_gguf(tmp_path / "g.gguf").config
    assert (cfg.attn_logit_softcapping, cfg.final_logit_softcapping) == (50.0, 30.0)
    assert (cfg.sliding_window, cfg.sliding_window_pattern) == (4096, 2)
    assert cfg.query_pre_attn_scalar == 16.0 and cfg.head_dim == 8
    write_gemma3_gguf(tmp_path / "p.gguf", {"layers": 3}, arch="gemma2", f16=False,
                      meta={"gemma2.attention.sliding_window_pattern": 3})
    cfg = read_gguf(tmp_path / "p.gguf").config
    assert cfg.sliding_window_pattern == 3 and [cfg.sliding(i) for i in range(3)] == [True, True, False]
    assert cfg.query_pre_attn_scalar == 32.0  # head_dim: not the 27B


@pytest.mark.parametrize(("meta", "names"), [
    ({"gemma2.attn_logit_softcapping": -1.0}, "gemma2.attn_logit_softcapping"),
    ({"gemma2.final_logit_softcapping": float("inf")}, "gemma2.final_logit_softcapping"),
    ({"gemma2.rope.scaling.type": "yarn", "gemma2.rope.scaling.factor": 4.0},
     "gemma2.rope.scaling.type"),
])
def test_refusals_name_the_key(tmp_path: Path, meta: dict[str, Any], names: str) -> None:
    write_gemma3_gguf(tmp_path / "g.gguf", {"layers": 1}, arch="gemma2", meta=meta, f16=False)
    with pytest.raises(ValidationError, match=names.replace(".", r"\.")):
        read_gguf(tmp_path / "g.gguf")
