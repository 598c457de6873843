"""``calserve pack`` of a Hugging Face ``Gemma3ForCausalLM`` checkpoint written here (F32
safetensors + config.json, Gemma's raw norm weights w of ``x_normed * (1 + w)``).

The package's numpy reference must compute what :func:`hf_gemma3_logits` computes: a forward
written here from transformers' modeling_gemma3 (no code shared with calserve): the embedding
times sqrt(hidden_size), ``Gemma3RMSNorm`` (``* (1 + w)``), q/k norms, rotate-half RoPE from
``rope_local_base_freq`` on a layer whose ``layer_types`` entry is "sliding_attention" (every
layer but each ``sliding_window_pattern``-th) and ``rope_theta`` on the others, scores times
``query_pre_attn_scalar ** -0.5``, a sliding layer's key masked unless ``kv_idx > q_idx -
sliding_window``, the sandwich norms, ``gelu_pytorch_tanh``, the tied head — over the whole
sequence at once, on prompts longer than the window. The 4B and up's ``rope_scaling``
{"rope_type": "linear", "factor": 8}: the global rotary embedding's inv_freq divided by the factor
(``_compute_linear_scaling_rope_parameters``), the local one (``rope_scaling`` reset to
"default") unscaled. The refusals name the key.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from calserve.config import TrustConfig
from calserve.errors import ValidationError
from calserve.models.demo import demo_tokenizer_json
from calserve.models.hf import load_hf_checkpoint
from calserve.models.pack import pack_from_hf
from calserve.models.package import open_package
from calserve.models.signing import TrustStore, generate_keypair
from calserve.runtime.reference import ModelConfig, ReferenceModel

N_VOCAB = len(json.loads(demo_tokenizer_json())["model"]["vocab"]) + 3  # + the added specials
CONFIG: dict[str, Any] = {
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": N_VOCAB,
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 7, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 32, "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10_000.0, "sliding_window": 4, "sliding_window_pattern": 6,
    "query_pre_attn_scalar": 24, "hidden_activation": "gelu_pytorch_tanh",
    "final_logit_softcapping": None, "attn_logit_softcapping": None, "rope_scaling": None,
    "max_position_embeddings": 512, "attention_bias": False, "torch_dtype": "float32",
}  # no tie_word_embeddings: Gemma3TextConfig's default (True)


def _weights(seed: int = 0, c: dict[str, Any] = CONFIG) -> dict[str, np.ndarray]:
    """HF names and shapes (of config ``c``); norm weights are Gemma's raw w (near 0)."""
    rng = np.random.default_rng(seed)
    h, hd, ff = c["hidden_size"], c["head_dim"], c["intermediate_size"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd

    def mat(r: int, k: int, s: float | None = None) -> np.ndarray:
        return (rng.standard_normal((r, k)) * (s or 1 / math.sqrt(k))).astype(np.float32)

    w = {"model.embed_tokens.weight": mat(N_VOCAB, h, 0.1),
         "model.norm.weight": (0.2 * rng.standard_normal(h)).astype(np.float32)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w.update({p + "self_attn.q_proj.weight": mat(q, h), p + "self_attn.k_proj.weight": mat(kv, h),
                  p + "self_attn.v_proj.weight": mat(kv, h), p + "self_attn.o_proj.weight": mat(h, q),
                  p + "mlp.gate_proj.weight": mat(ff, h), p + "mlp.up_proj.weight": mat(ff, h),
                  p + "mlp.down_proj.weight": mat(h, ff)})
        for n, size in (("input_layernorm", h), ("post_attention_layernorm", h),
                        ("pre_feedforward_layernorm", h), ("post_feedforward_layernorm", h),
                        ("self_attn.q_norm", hd), ("self_attn.k_norm", hd)):
            w[p + n + ".weight"] = (0.2 * rng.standard_normal(size)).astype(np.float32)
    return w


def _f32_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    header, blobs, off = {}, [], 0
    for name, a in tensors.items():
        raw = np.ascontiguousarray(a, "<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(a.shape), "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    hb = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(hb)) + hb + b"".join(blobs))


def hf_gemma3_logits(cfg: dict[str, Any], w: dict[str, np.ndarray], ids: list[int]) -> np.ndarray:
    """modeling_gemma3's forward over ``ids`` (logits [T, vocab]; module docstring); a Gemma 2
    config (modeling_gemma2): no q/k norms, one RoPE base, the scores and the logits soft-capped."""
    T, H, KV, D = len(ids), cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    eps = cfg["rms_norm_eps"]
    types = cfg.get("layer_types") or [  # Gemma 2 (modeling_gemma2): every other layer
        "sliding_attention" if (i + 1) % cfg.get("sliding_window_pattern", 2) else "full_attention"
        for i in range(cfg["num_hidden_layers"])]
    attn_cap, final_cap = cfg.get("attn_logit_softcapping"), cfg.get("final_logit_softcapping")

    def cap(x: np.ndarray, c: float | None) -> np.ndarray:  # x / c, tanh, * c
        return x if c is None else (np.tanh(x / np.float32(c)) * np.float32(c)).astype(np.float32)

    def norm(x: np.ndarray, wt: np.ndarray) -> np.ndarray:  # Gemma3RMSNorm
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * (1.0 + wt)

    scaling = cfg.get("rope_scaling") or {"rope_type": "default"}
    assert scaling.get("rope_type", scaling.get("type")) in ("default", "linear"), scaling
    factor = float(scaling.get("factor", 1.0)) if scaling.get("rope_type", scaling.get("type")) == "linear" \
        else 1.0

    def rope(x: np.ndarray, base: float, div: float) -> np.ndarray:  # x [T, heads, D]; rotate_half
        inv = 1.0 / base ** (np.arange(0, D, 2, dtype=np.float64) / D) / div
        emb = np.concatenate([np.outer(np.arange(T), inv)] * 2, axis=-1)  # [T, D]
        cos, sin = np.cos(emb)[:, None, :], np.sin(emb)[:, None, :]
        rot = np.concatenate([-x[..., D // 2:], x[..., : D // 2]], axis=-1)
        return (x * cos + rot * sin).astype(np.float32)

    q_idx, kv_idx = np.arange(T)[:, None], np.arange(T)[None, :]
    x = w["model.embed_tokens.weight"][ids] * np.float32(cfg["hidden_size"] ** 0.5)
    for i, kind in enumerate(types):
        p = f"model.layers.{i}."
        sliding = kind == "sliding_attention"
        h = norm(x, w[p + "input_layernorm.weight"])
        q = (h @ w[p + "self_attn.q_proj.weight"].T).reshape(T, H, D)
        k = (h @ w[p + "self_attn.k_proj.weight"].T).reshape(T, KV, D)
        if p + "self_attn.q_norm.weight" in w:  # Gemma 3 (Gemma 2 has none)
            q, k = norm(q, w[p + "self_attn.q_norm.weight"]), norm(k, w[p + "self_attn.k_norm.weight"])
        v = (h @ w[p + "self_attn.v_proj.weight"].T).reshape(T, KV, D)
        base = cfg.get("rope_local_base_freq", cfg["rope_theta"]) if sliding else cfg["rope_theta"]
        div = 1.0 if sliding else factor  # rotary_emb_local has no scaling; rotary_emb has it
        q, k = rope(q, base, div), rope(k, base, div)
        allowed = kv_idx <= q_idx
        if sliding:
            allowed &= kv_idx > q_idx - cfg["sliding_window"]
        out = np.empty((T, H, D), np.float32)
        for hh in range(H):
            g = hh // (H // KV)  # repeat_kv
            s = cap((q[:, hh] @ k[:, g].T) * cfg["query_pre_attn_scalar"] ** -0.5, attn_cap)
            s = np.where(allowed, s, -np.inf)
            pr = np.exp(s - s.max(axis=-1, keepdims=True))
            out[:, hh] = (pr / pr.sum(axis=-1, keepdims=True)) @ v[:, g]
        a = out.reshape(T, H * D) @ w[p + "self_attn.o_proj.weight"].T
        x = x + norm(a, w[p + "post_attention_layernorm.weight"])
        h = norm(x, w[p + "pre_feedforward_layernorm.weight"])
        g64 = (h @ w[p + "mlp.gate_proj.weight"].T).astype(np.float64)  # gelu_pytorch_tanh
        act = 0.5 * g64 * (1 + np.tanh(math.sqrt(2 / math.pi) * (g64 + 0.044715 * g64 ** 3)))
        m = (act.astype(np.float32) * (h @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
        x = x + norm(m, w[p + "post_feedforward_layernorm.weight"])
    return cap(np.asarray(norm(x, w["model.norm.weight"]) @ w["model.embed_tokens.weight"].T,
                          np.float32), final_cap)


def _write(d: Path, cfg: dict[str, Any], w: dict[str, np.ndarray]) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg))
    _f32_safetensors(d / "model.safetensors", w)
    (d / "tokenizer.json").write_text(demo_tokenizer_json())
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0], "bos_token_id": 1}))
    (d / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": True}))
    return d


def _greedy(step: Any, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    toks, lps, logits = [], [], step(prompt)
    for _ in range(n):
        z = logits.astype(np.float64)
        toks.append(int(np.argmax(z)))
        lps.append(float(z[toks[-1]] - z.max() - np.log(np.exp(z - z.max()).sum())))
        logits = step([toks[-1]])
    return toks, lps


PROMPT = [5, 17, 99, 3, 250, 41, 8, 77, 120, 64, 2, 31]  # 12 tokens, three windows


def reference_equals_hf(c: ModelConfig, weights: Any, hf_config: dict[str, Any],
                        w: dict[str, np.ndarray], prompt: list[int]) -> None:
    """The package's reference (config ``c``, its ``weights``) gives the greedy tokens and
    logprobs (within 1e-3) of the test's transformers-style forward of ``hf_config`` and the
    checkpoint's ``w``, 6 steps after ``prompt``."""
    ref = ReferenceModel(c, weights)
    got = _greedy(lambda ids: ref.forward(ids)[-1], prompt, 6)
    seq: list[int] = []

    def hf_step(ids: list[int]) -> np.ndarray:
        seq.extend(ids)
        return hf_gemma3_logits(hf_config, w, seq)[-1]

    want = _greedy(hf_step, prompt, 6)
    assert got[0] == want[0] and np.allclose(got[1], want[1], atol=1e-3), (got, want)


def test_packed_reference_computes_what_transformers_computes(tmp_path: Path) -> None:
    """Config mapped (sliding layers, local RoPE base, query_pre_attn_scalar, tied by default);
    norms stored as 1 + w; greedy tokens equal and logprobs within 1e-3 of the HF forward on a
    prompt longer than the window; the golden tokens run on the software runtime."""
    from calserve.models.devicecheck import golden_run
    from calserve.runtime import Device

    w = _weights()
    d = _write(tmp_path / "ck", CONFIG, w)
    ck = load_hf_checkpoint(d)
    c = ck.config
    assert c.architecture == "Gemma3ForCausalLM" and c.tie_word_embeddings
    assert (c.sliding_window, c.sliding_window_pattern, c.rope_local_theta) == (4, 6, 10000.0)
    assert c.query_pre_attn_scalar == 24.0 and c.rope_theta == 1_000_000.0
    assert np.array_equal(ck.weights["model.layers.3.post_feedforward_layernorm.weight"],
                          w["model.layers.3.post_feedforward_layernorm.weight"] + np.float32(1))
    up = "model.layers.0.mlp.up_proj.weight"
    assert np.array_equal(ck.weights[up], w[up])
    priv, pub = generate_keypair(tmp_path / "key")
    out = pack_from_hf(d, tmp_path / "root" / "pkg", priv, [1], "none", max_seq=64)
    vp = open_package(out, TrustStore.from_config(TrustConfig(trust_dev_key=False), [pub]), out.parent)
    assert vp.manifest.model_config() == c and vp.manifest.special_tokens.add_bos_token
    reference_equals_hf(vp.manifest.model_config(), vp.weights(), CONFIG, w, PROMPT)
    unwindowed = hf_gemma3_logits({**CONFIG, "sliding_window": 100}, w, PROMPT)[-1]
    assert np.abs(unwindowed - hf_gemma3_logits(CONFIG, w, PROMPT)[-1]).max() > 1e-2  # it matters
    with Device.open(profile="sim-next") as dev:
        ok, detail = golden_run(dev, vp, 1)
        assert ok, detail


def test_layer_types_and_rope_parameters_forms(tmp_path: Path) -> None:
    """Newer transformers spell the pattern as ``layer_types`` and the bases as ``rope_parameters``:
    the same config; all-full layer types: no window."""
    w = _weights(1)
    base = load_hf_checkpoint(_write(tmp_path / "a", CONFIG, w)).config
    types = ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(7)]
    newer = {k: v for k, v in CONFIG.items()
             if k not in ("sliding_window_pattern", "rope_theta", "rope_local_base_freq")}
    newer.update(layer_types=types, rope_parameters={
        "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}})
    assert load_hf_checkpoint(_write(tmp_path / "b", newer, w)).config == base
    full = load_hf_checkpoint(_write(tmp_path / "c", {**newer, "layer_types": ["full_attention"] * 7}, w))
    assert full.config.sliding_window == 0 and not any(full.config.sliding(i) for i in range(7))


LINEAR = {"rope_type": "linear", "factor": 8.0}  # Gemma 3 4B, 12B, 27B


def test_linear_rope_scaling_of_the_global_layers(tmp_path: Path) -> None:
    """``rope_scaling`` linear, factor 8 (the 4B+): ``rope_scaling_factor`` 8, the global layer
    scaled and the sliding ones not; on a 40-token prompt (ten windows) greedy tokens equal and
    logprobs within 1e-3 of the HF forward; the factor matters; the ``rope_parameters`` spelling
    gives the same config; the golden tokens run on the software runtime."""
    from calserve.models.devicecheck import golden_run
    from calserve.runtime import Device

    w = _weights(3)
    cfg = {**CONFIG, "rope_scaling": LINEAR}
    d = _write(tmp_path / "ck", cfg, w)
    c = load_hf_checkpoint(d).config
    assert c.rope_scaling_factor == 8.0 and not c.rope_freqs
    assert [c.layer_rope_factor(i) for i in range(7)] == [1.0] * 5 + [8.0, 1.0]
    priv, pub = generate_keypair(tmp_path / "key")
    out = pack_from_hf(d, tmp_path / "root" / "pkg", priv, [1], "none", max_seq=64)
    vp = open_package(out, TrustStore.from_config(TrustConfig(trust_dev_key=False), [pub]), out.parent)
    assert vp.manifest.model_config() == c
    prompt = PROMPT + [9, 120, 33, 7, 250, 61, 18, 90, 4, 111, 27, 300, 15, 44, 8, 170, 66, 23,
                       140, 5, 99, 12, 230, 38, 71, 3, 160, 52]  # 40 tokens
    reference_equals_hf(c, vp.weights(), cfg, w, prompt)
    scaled = hf_gemma3_logits(cfg, w, prompt)[-1]
    assert np.abs(hf_gemma3_logits(CONFIG, w, prompt)[-1] - scaled).max() > 1e-2  # it matters
    newer = {k: v for k, v in cfg.items() if k not in ("rope_scaling", "rope_theta", "rope_local_base_freq")}
    newer["rope_parameters"] = {"full_attention": {**LINEAR, "rope_theta": 1_000_000.0},
                                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}
    assert load_hf_checkpoint(_write(tmp_path / "newer", newer, w)).config == c
    with Device.open(profile="sim-next") as dev:
        ok, detail = golden_run(dev, vp, 1)
        assert ok, detail


@pytest.mark.parametrize(("change", "names"), [
    ({"hidden_activation": "gelu"}, "hidden_activation"),
    ({"final_logit_softcapping": 30.0}, "final_logit_softcapping"),
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 8.0}}, "rope_scaling 'yarn'"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling 'llama3'"),
    ({"rope_scaling": {"rope_type": "linear"}}, r"rope_scaling\.factor None"),
    ({"rope_scaling": {"type": "linear", "factor": 0}}, r"rope_scaling\.factor 0"),
    ({"rope_scaling": {"rope_type": "linear", "factor": -8.0}}, r"rope_scaling\.factor -8"),
    ({"rope_scaling": {"rope_type": "linear", "factor": "8"}}, r"rope_scaling\.factor '8'"),
    ({"rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 0.0}}},
     r"rope_parameters\.full_attention\.factor"),
    ({"rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 8.0}}},
     r"rope_parameters\.full_attention\.rope_type"),
    ({"rope_scaling": LINEAR, "rope_parameters": {"full_attention": {**LINEAR, "factor": 4.0}}},
     r"rope_parameters\.full_attention\.factor 4\.0 != rope_scaling\.factor 8\.0"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"layer_types": ["sliding_attention", "full_attention", "full_attention"] + ["sliding_attention"] * 4},
     "layer_types"),
    ({"rope_parameters": {"sliding_attention": {"rope_type": "yarn", "factor": 2.0}}},
     r"rope_parameters\.sliding_attention\.rope_type"),
    ({"architectures": ["Gemma3ForConditionalGeneration"]}, "text_config is NoneType"),
    ({"architectures": ["Gemma3nForConditionalGeneration"]}, "architectures"),
])
def test_refusals_name_the_key(tmp_path: Path, change: dict[str, Any], names: str) -> None:
    d = _write(tmp_path / "ck", {**CONFIG, **change}, _weights(2))
    with pytest.raises(ValidationError, match=names):
        load_hf_checkpoint(d)


# Gemma3ForConditionalGeneration (4B, 12B, 27B): its text model, the vision parts left out. The
# text_config leaves num_attention_heads (8), num_key_value_heads (4), rms_norm_eps, rope_theta,
# rope_local_base_freq, sliding_window_pattern, hidden_activation, max_position_embeddings and
# tie_word_embeddings to Gemma3TextConfig's defaults, as the 4B's does; TEXT is the same model as a
# Gemma3ForCausalLM config with every key spelled out.
TEXT = {**CONFIG, "num_attention_heads": 8, "num_key_value_heads": 4, "rope_scaling": LINEAR,
        "max_position_embeddings": 131072}
MM_CONFIG: dict[str, Any] = {
    "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
    "text_config": {"model_type": "gemma3_text", "vocab_size": N_VOCAB, "hidden_size": 64,
                    "intermediate_size": 128, "num_hidden_layers": 7, "head_dim": 32,
                    "sliding_window": 4, "query_pre_attn_scalar": 24, "rope_scaling": LINEAR},
    "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 8, "num_hidden_layers": 1},
    "mm_tokens_per_image": 4, "boi_token_index": 255_999, "eoi_token_index": 256_000,
    "image_token_index": 262_144, "eos_token_id": [1, 106], "torch_dtype": "float32",
}
VISION = {  # a few of SigLIP's and the projector's (two of them end in norm.weight)
    "vision_tower.vision_model.embeddings.patch_embedding.weight": (8, 3, 2, 2),
    "vision_tower.vision_model.encoder.layers.0.self_attn.q_proj.weight": (8, 8),
    "vision_tower.vision_model.post_layernorm.weight": (8,),
    "multi_modal_projector.mm_input_projection_weight": (8, 64),
    "multi_modal_projector.mm_soft_emb_norm.weight": (8,),
}


def _mm_tensors(w: dict[str, np.ndarray], newer: bool) -> dict[str, np.ndarray]:
    """Text weights ``w`` (Gemma3ForCausalLM names) and the vision parts as transformers writes a
    Gemma3ForConditionalGeneration: >= 4.52 ``model.language_model.*``, ``model.vision_tower.*``,
    ``lm_head.weight``; before, ``language_model.model.*``, ``language_model.lm_head.weight``."""
    rng = np.random.default_rng(9)
    text = "model.language_model." if newer else "language_model.model."
    out = {text + k[len("model."):]: v for k, v in w.items() if k.startswith("model.")}
    out["lm_head.weight" if newer else "language_model.lm_head.weight"] = w["model.embed_tokens.weight"]
    for k, shape in VISION.items():
        out[("model." if newer else "") + k] = rng.standard_normal(shape).astype(np.float32)
    return out


@pytest.mark.parametrize("newer", [True, False], ids=["model.language_model", "language_model.model"])
def test_conditional_generation_packs_its_text_model(
        tmp_path: Path, newer: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Either tensor spelling: the config is the Gemma3ForCausalLM one of the same text model
    (defaults filled in, linear RoPE scaling of the global layers), the weights the same, the
    vision tensors (and the tied head) never read, the note says what was left out, EOS ids from
    the top level; the package's reference computes what transformers computes (greedy tokens
    equal, logprobs within 1e-3) and its golden tokens run on the software runtime."""
    import calserve.models.hf as hf
    from calserve.models.devicecheck import golden_run
    from calserve.runtime import Device

    w = _weights(4, TEXT)
    want_ck = load_hf_checkpoint(_write(tmp_path / "causal", TEXT, w))
    d = _write(tmp_path / "mm", MM_CONFIG, _mm_tensors(w, newer))
    (d / "generation_config.json").unlink()  # EOS from config.json's top level
    reads: list[list[int]] = []
    real = hf._to_f32

    def counted(buf: bytes, dtype: str, shape: list[int]) -> np.ndarray:
        reads.append(shape)
        return real(buf, dtype, shape)

    monkeypatch.setattr(hf, "_to_f32", counted)
    ck = load_hf_checkpoint(d)
    monkeypatch.undo()
    assert len(reads) == len(w)  # the text model's tensors only
    c = ck.config
    assert c == want_ck.config and c.architecture == "Gemma3ForCausalLM" and c.tie_word_embeddings
    assert (c.num_attention_heads, c.num_key_value_heads, c.vocab_size) == (8, 4, N_VOCAB)
    assert c.rope_scaling_factor == 8.0 and c.max_position_embeddings == 131072
    assert ck.weights.keys() == want_ck.weights.keys()
    assert all(np.array_equal(ck.weights[k], want_ck.weights[k]) for k in ck.weights)
    assert ck.eos_token_ids == (1, 106) and ck.source_dtype == "F32"
    assert "vision tower and multi-modal projector (5 tensors) left out" in ck.note
    priv, pub = generate_keypair(tmp_path / "key")
    out = pack_from_hf(d, tmp_path / "root" / "pkg", priv, [1], "none", max_seq=64)
    vp = open_package(out, TrustStore.from_config(TrustConfig(trust_dev_key=False), [pub]), out.parent)
    assert vp.manifest.model_config() == c
    assert "left out" in vp.manifest.source  # the package says what it is not
    reference_equals_hf(c, vp.weights(), TEXT, w, PROMPT)
    with Device.open(profile="sim-next") as dev:
        ok, detail = golden_run(dev, vp, 1)
        assert ok, detail


def test_conditional_generation_untied_head_and_shards(tmp_path: Path) -> None:
    """``tie_word_embeddings`` false at the top level: the head is kept as ``lm_head.weight``;
    the vision parts in a shard of their own (``model.safetensors.index.json``) are left out."""
    w = _weights(5, TEXT)
    w["lm_head.weight"] = w["model.embed_tokens.weight"][::-1].copy()
    tensors = _mm_tensors(w, newer=False)
    tensors["language_model.lm_head.weight"] = w["lm_head.weight"]
    d = _write(tmp_path / "mm", {**MM_CONFIG, "tie_word_embeddings": False}, {})
    (d / "model.safetensors").unlink()
    shard = {k: ("vision.safetensors" if k in VISION else "text.safetensors") for k in tensors}
    for f in set(shard.values()):
        _f32_safetensors(d / f, {k: v for k, v in tensors.items() if shard[k] == f})
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": shard}))
    ck = load_hf_checkpoint(d)
    assert not ck.config.tie_word_embeddings
    assert np.array_equal(ck.weights["lm_head.weight"], w["lm_head.weight"])
    assert ck.config == load_hf_checkpoint(
        _write(tmp_path / "causal", {**TEXT, "tie_word_embeddings": False}, w)).config


@pytest.mark.parametrize(("change", "extra", "names"), [
    ({"text_config": None}, {}, "text_config is NoneType"),
    ({"text_config": [1]}, {}, "text_config is list"),
    ({"tie_word_embeddings": False, "text_config": {**MM_CONFIG["text_config"], "tie_word_embeddings": True}},
     {}, "tie_word_embeddings False != text_config.tie_word_embeddings True"),
    ({"text_config": {**MM_CONFIG["text_config"], "rope_scaling": {"rope_type": "yarn", "factor": 8.0}}},
     {}, "text_config: rope_scaling 'yarn'"),
    ({"text_config": {**MM_CONFIG["text_config"], "final_logit_softcapping": 30.0}},
     {}, "text_config: final_logit_softcapping"),
    ({}, {"audio_tower.conv.weight": np.zeros(2, np.float32)}, "unexpected tensor audio_tower.conv.weight"),
    ({}, {"model.layers.0.mlp.up_proj.weight": np.zeros(2, np.float32)},
     r"unexpected tensor model\.layers\.0\.mlp\.up_proj\.weight"),
    ({}, {"language_model.model.norm.weight": np.zeros(64, np.float32)},
     "norm.weight': model.norm.weight is also spelled another way"),
    ({}, {"model.language_model.layers.7.mlp.up_proj.weight": np.zeros(2, np.float32)},
     "unexpected tensor model.layers.7.mlp.up_proj.weight"),
])
def test_conditional_generation_refusals_name_it(
        tmp_path: Path, change: dict[str, Any], extra: dict[str, np.ndarray], names: str) -> None:
    d = _write(tmp_path / "mm", {**MM_CONFIG, **change}, {**_mm_tensors(_weights(6, TEXT), True), **extra})
    with pytest.raises(ValidationError, match=names):
        load_hf_checkpoint(d)
