"""``calserve pack`` of a Hugging Face ``Gemma2ForCausalLM`` checkpoint written here (F32
safetensors, Gemma's raw norm weights): the package's reference and the software runtime compute
what the transformers-style forward of :mod:`tests.models.test_hf_gemma3` computes for a Gemma 2
config (modeling_gemma2: no q/k norms, every other layer sliding, one RoPE base, scores
``c * tanh(s / c)`` after the ``query_pre_attn_scalar`` scale and before the mask, the logits
capped the same way). Caps given as null mean none; absent, transformers' 50 and 30."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from calserve.config import TrustConfig
from calserve.errors import ValidationError
from calserve.models.hf import load_hf_checkpoint
from calserve.models.pack import pack_from_hf
from calserve.models.package import open_package
from calserve.models.signing import TrustStore, generate_keypair

from .test_hf_gemma3 import CONFIG as GEMMA3, PROMPT, _weights, _write, hf_gemma3_logits, reference_equals_hf

CONFIG: dict[str, Any] = {
    **{k: v for k, v in GEMMA3.items()
       if k not in ("rope_local_base_freq", "sliding_window_pattern")},
    "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "rope_theta": 10_000.0,
    "attn_logit_softcapping": 3.0, "final_logit_softcapping": 4.0,  # tight: they matter
}


def _gemma2_weights(seed: int = 0) -> dict[str, np.ndarray]:
    return {k: v for k, v in _weights(seed).items() if ".q_norm." not in k and ".k_norm." not in k}


def test_packed_reference_and_runtime_compute_what_transformers_computes(tmp_path: Path) -> None:
    from calserve.models.devicecheck import golden_run
    from calserve.runtime import Device

    w = _gemma2_weights()
    d = _write(tmp_path / "ck", CONFIG, w)
    c = load_hf_checkpoint(d).config
    assert c.architecture == "Gemma2ForCausalLM" and c.gemma and not c.qk_norm
    assert (c.attn_logit_softcapping, c.final_logit_softcapping) == (3.0, 4.0)
    assert (c.sliding_window, c.sliding_window_pattern, c.rope_local_theta) == (4, 2, 0.0)
    assert c.query_pre_attn_scalar == 24.0 and c.tie_word_embeddings
    priv, pub = generate_keypair(tmp_path / "key")
    out = pack_from_hf(d, tmp_path / "root" / "pkg", priv, [1], "none", max_seq=64)
    vp = open_package(out, TrustStore.from_config(TrustConfig(trust_dev_key=False), [pub]), out.parent)
    assert vp.manifest.model_config() == c
    reference_equals_hf(c, vp.weights(), CONFIG, w, PROMPT)
    capped = hf_gemma3_logits(CONFIG, w, PROMPT)[-1]
    for other in ({**CONFIG, "attn_logit_softcapping": None}, {**CONFIG, "final_logit_softcapping": None}):
        assert np.abs(hf_gemma3_logits(other, w, PROMPT)[-1] - capped).max() > 1e-2  # each matters
    with Device.open(profile="sim-next") as dev:
        ok, detail = golden_run(dev, vp, 1)
        assert ok, detail


def test_caps_absent_null_and_layer_types(tmp_path: Path) -> None:
    """Absent caps: transformers' defaults; null: none; ``layer_types`` and a flat
    ``rope_parameters`` (newer transformers) spell the same model."""
    w = _gemma2_weights(1)
    absent = {k: v for k, v in CONFIG.items() if not k.endswith("softcapping")}
    c = load_hf_checkpoint(_write(tmp_path / "a", absent, w)).config
    assert (c.attn_logit_softcapping, c.final_logit_softcapping) == (50.0, 30.0)
    c = load_hf_checkpoint(_write(tmp_path / "n", {**CONFIG, "final_logit_softcapping": None}, w)).config
    assert (c.attn_logit_softcapping, c.final_logit_softcapping) == (3.0, 0.0)
    base = load_hf_checkpoint(_write(tmp_path / "b", CONFIG, w)).config
    newer = {**{k: v for k, v in CONFIG.items() if k != "rope_theta"},
             "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(7)],
             "rope_parameters": {"rope_type": "default", "rope_theta": 10_000.0}}
    assert load_hf_checkpoint(_write(tmp_path / "c", newer, w)).config == base


@pytest.mark.parametrize(("change", "names"), [
    ({"attn_logit_softcapping": -1.0}, "attn_logit_softcapping"),
    ({"final_logit_softcapping": "x"}, "final_logit_softcapping"),
    ({"hidden_activation": "gelu"}, "hidden_activation"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0}}, "rope_parameters"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_scaling"),
])
def test_refusals_name_the_key(tmp_path: Path, change: dict[str, Any], names: str) -> None:
    d = _write(tmp_path / "ck", {**CONFIG, **change}, _gemma2_weights(2))
    with pytest.raises(ValidationError, match=names):
        load_hf_checkpoint(d)


def test_other_families_ignore_softcap_keys() -> None:
    """Only Gemma 2 is soft-capped: a Llama or Qwen config that carries the keys is computed as
    transformers computes those families, which read none of them."""
    from calserve.runtime.reference import ModelConfig

    for arch in ("LlamaForCausalLM", "Qwen3ForCausalLM"):
        c = ModelConfig.from_hf({
            "architectures": [arch], "vocab_size": 64, "hidden_size": 16, "intermediate_size": 32,
            "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
            "head_dim": 8, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0})
        assert (c.attn_logit_softcapping, c.final_logit_softcapping) == (0.0, 0.0)
