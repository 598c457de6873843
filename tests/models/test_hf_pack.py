"""Round trip: a HF-format Qwen3 checkpoint written by hand (random weights, BF16 safetensors, sharded
with an index) packs, verifies, and its golden tokens equal the numpy reference — and the software
runtime's output at every profile once the runtime exists."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from calserve.config import TrustConfig
from calserve.errors import ValidationError
from calserve.models.demo import demo_tokenizer_json
from calserve.models.hf import load_hf_checkpoint, load_safetensors, write_safetensors
from calserve.models.pack import pack_from_hf
from calserve.models.package import open_package
from calserve.models.signing import TrustStore, generate_keypair
from calserve.runtime.reference import ModelConfig, bf16_round, greedy_generate, random_weights

# A checkpoint's own chat template (valid Jinja: a package whose template does not compile is refused).
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


def _raw_bf16_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    """An independent writer (truncating BF16 like a checkpoint exporter may): header + raw bytes."""
    header, blobs, off = {}, [], 0
    for name, a in tensors.items():
        raw = (np.ascontiguousarray(a, np.float32).view(np.uint32) >> 16).astype("<u2").tobytes()
        header[name] = {"dtype": "BF16", "shape": list(a.shape), "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    header["__metadata__"] = {"format": "pt"}
    hb = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(hb)) + hb + b"".join(blobs))


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("hf-qwen3")
    tok_json = demo_tokenizer_json()
    vocab = json.loads(tok_json)["model"]["vocab"]
    n_vocab = len(vocab) + 3  # + the three added special tokens
    cfg = {
        "architectures": ["Qwen3ForCausalLM"],
        "vocab_size": n_vocab,
        "hidden_size": 48,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 12,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "max_position_embeddings": 512,
        "torch_dtype": "bfloat16",
    }
    (d / "config.json").write_text(json.dumps(cfg))
    w = random_weights(ModelConfig.from_hf(cfg), seed=7)
    names = sorted(w)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    for shard, ns in shards.items():
        _raw_bf16_safetensors(d / shard, {n: w[n] for n in ns})
    (d / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {n: s for s, ns in shards.items() for n in ns}})
    )
    (d / "tokenizer.json").write_text(tok_json)
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0], "pad_token_id": 0}))
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    return d


def test_hf_llama_checkpoint_is_the_llama_family(hf_dir: Path, tmp_path: Path) -> None:
    """An HF ``LlamaForCausalLM`` (rotate-half layout already: nothing to un-permute) reads as the
    Llama family: no q/k norm tensors expected; biases and RoPE scaling are refused by name."""
    import shutil

    d = tmp_path / "llama"
    shutil.copytree(hf_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["LlamaForCausalLM"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValidationError, match="unexpected tensor .*_norm.* for a LlamaForCausalLM"):
        load_hf_checkpoint(d)  # the Qwen3 shards carry q_norm/k_norm: not a Llama's tensors
    for key, val in (("attention_bias", True), ("rope_scaling", {"type": "dynamic", "factor": 2.0})):
        (d / "config.json").write_text(json.dumps({**cfg, key: val}))
        with pytest.raises(ValidationError, match=key):
            load_hf_checkpoint(d)


def _pack_and_check_golden(d: Path, ck: Any, tmp_path: Path) -> Any:
    """Pack the checkpoint ``d`` (B1, B4); its golden tokens equal the reference's and the
    software runtime's at both profiles. Returns the opened package."""
    from calserve.models.devicecheck import golden_run
    from calserve.runtime import Device

    priv, pub = generate_keypair(tmp_path / "key")
    out = pack_from_hf(d, tmp_path / "root" / "pkg", priv, [1, 4], "none", max_seq=128)
    vp = open_package(out, TrustStore.from_config(TrustConfig(trust_dev_key=False), [pub]), out.parent)
    for case in vp.golden().cases:
        for toks in case.expected.values():
            assert toks == greedy_generate(ck.config, ck.weights, case.prompt, len(toks))
    with Device.open(profile="sim-next") as dev:
        for b in (1, 4):
            ok, detail = golden_run(dev, vp, b)
            assert ok, f"B{b}: {detail}"
    return vp


def test_hf_qwen2_checkpoint_packs_with_its_biases(hf_dir: Path, tmp_path: Path) -> None:
    """An HF ``Qwen2ForCausalLM`` (Qwen2/2.5: Llama plus q/k/v projection biases) packs; its golden
    tokens equal the reference's and the software runtime's at B1 and B4; a checkpoint without its
    biases, and one with sliding-window attention on, are refused by name."""
    d = tmp_path / "qwen2"
    d.mkdir()
    for f in ("tokenizer.json", "generation_config.json", "tokenizer_config.json"):
        (d / f).write_text((hf_dir / f).read_text())
    cfg = {**json.loads((hf_dir / "config.json").read_text()), "architectures": ["Qwen2ForCausalLM"],
           "rope_theta": 1000000.0, "use_sliding_window": False, "sliding_window": 32768}
    del cfg["head_dim"]  # Qwen2's config.json has none: hidden / heads
    (d / "config.json").write_text(json.dumps(cfg))
    w = random_weights(ModelConfig.from_hf(cfg), seed=3)
    assert "model.layers.1.self_attn.k_proj.bias" in w
    _raw_bf16_safetensors(d / "model.safetensors", w)
    ck = load_hf_checkpoint(d)
    assert ck.config.architecture == "Qwen2ForCausalLM" and ck.config.head_dim == 12
    vp = _pack_and_check_golden(d, ck, tmp_path)
    assert vp.manifest.model_config() == ck.config
    (d / "config.json").write_text(json.dumps({**cfg, "use_sliding_window": True}))
    with pytest.raises(ValidationError, match="use_sliding_window"):
        load_hf_checkpoint(d)
    (d / "config.json").write_text(json.dumps(cfg))
    _raw_bf16_safetensors(d / "model.safetensors",
                          {k: v for k, v in w.items() if k != "model.layers.0.self_attn.v_proj.bias"})
    with pytest.raises(ValidationError, match=r"v_proj\.bias missing for a Qwen2ForCausalLM"):
        load_hf_checkpoint(d)


def test_hf_checkpoint_reads_bf16_exactly(hf_dir: Path) -> None:
    ck = load_hf_checkpoint(hf_dir)
    ref = random_weights(ck.config, seed=7)
    assert ck.source_dtype == "BF16" and ck.eos_token_ids == (2, 0) and ck.pad_token_id == 0
    assert set(ck.weights) == set(ref)
    for k, v in ck.weights.items():
        truncated = (ref[k].view(np.uint32) & 0xFFFF0000).view(np.float32)
        np.testing.assert_array_equal(v, truncated)


@pytest.fixture(scope="module")
def packed(hf_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("packed")
    priv, pub = generate_keypair(d / "key")
    out = pack_from_hf(hf_dir, d / "root" / "pkg", priv, [1, 4, 8, 16], "fast", max_seq=256, kv_dtype="bf16")
    return out, pub


def test_pack_verify_golden_equals_reference(hf_dir: Path, packed: tuple[Path, Path]) -> None:
    out, pub = packed
    trust = TrustStore.from_config(TrustConfig(trust_dev_key=False), [pub])
    vp = open_package("pkg", trust, out.parent)
    m = vp.manifest
    assert m.compiled_batches == [1, 4, 8, 16] and m.timing.name == "fast"
    assert all(p.kv_dtype == "bf16" and p.max_seq == 256 for p in m.profiles)
    ck = load_hf_checkpoint(hf_dir)
    assert m.model_config() == ck.config
    # The checkpoint's own chat template and generation_config EOS ids travel into the package.
    assert m.chat_template == TEMPLATE
    assert m.special_tokens.eos_token_ids == [2, 0] and m.special_tokens.pad_token_id == 0
    assert m.special_tokens.eos_token == vp.tokenizer().id_to_token(2)
    w = vp.weights()
    for k in w:
        np.testing.assert_array_equal(w[k], ck.weights[k])  # stored BF16 as given: no double rounding
    for case in vp.golden().cases:
        for b, toks in case.expected.items():
            assert len(toks) >= 1
            assert toks == greedy_generate(ck.config, ck.weights, case.prompt, len(toks), "bf16")


def test_golden_matches_software_runtime_every_profile(packed: tuple[Path, Path]) -> None:
    runtime = pytest.importorskip("calserve._calrt", reason="software CalRT not built")
    del runtime
    from calserve.models.devicecheck import golden_run
    from calserve.runtime import Device

    out, pub = packed
    trust = TrustStore.from_config(TrustConfig(trust_dev_key=False), [pub])
    vp = open_package(out, trust, out.parent)
    with Device.open(profile="sim-next") as dev:
        for b in vp.manifest.compiled_batches:
            ok, detail = golden_run(dev, vp, b)
            assert ok, f"B{b}: {detail}"


@settings(max_examples=40)
@given(
    arrays(np.float32, st.tuples(st.integers(1, 5), st.integers(1, 7)),
           elements=st.floats(width=32, allow_nan=False)),
    st.sampled_from(["BF16", "F16", "F32"]),
)
def test_safetensors_round_trip(tmp_path_factory: pytest.TempPathFactory, a: np.ndarray, dtype: str) -> None:
    p = tmp_path_factory.mktemp("st") / "t.safetensors"
    write_safetensors(p, {"x": a, "y": a[:1]}, dtype)
    got = load_safetensors(p)
    if dtype == "BF16":
        want = bf16_round(a)
    elif dtype == "F16":
        with np.errstate(over="ignore"):
            want = a.astype(np.float16).astype(np.float32)
    else:
        want = a
    np.testing.assert_array_equal(got["x"], want)
    assert got["y"].shape == a[:1].shape


def test_safetensors_header_lies_refused(tmp_path: Path) -> None:
    from calserve.errors import ValidationError

    p = tmp_path / "bad.safetensors"
    hb = json.dumps({"x": {"dtype": "BF16", "shape": [4, 4], "data_offsets": [0, 8]}}).encode()
    p.write_bytes(struct.pack("<Q", len(hb)) + hb + b"\0" * 8)
    with pytest.raises(ValidationError, match="bad.safetensors: tensor 'x': data offsets"):
        load_safetensors(p)
    hb = json.dumps({"x": {"dtype": "I8", "shape": [1], "data_offsets": [0, 1]}}).encode()
    p.write_bytes(struct.pack("<Q", len(hb)) + hb + b"\0")
    with pytest.raises(ValidationError, match="dtype I8"):
        load_safetensors(p)


def test_hf_llama31_rope_scaling_is_its_divisors(hf_dir: Path, tmp_path: Path) -> None:
    """Llama 3.1+'s ``rope_scaling: {"rope_type": "llama3"}``: the package carries a divisor per RoPE
    frequency (F32 even in a BF16 package), equal to the ratio of the frequencies Hugging Face's
    ``_compute_llama3_parameters`` gives (written out here in its own form); golden tokens equal
    the reference's and the runtime's; other scaling types stay refused."""
    import math
    import shutil

    from calserve.runtime.reference import ROPE_FREQS

    d = tmp_path / "llama31"
    shutil.copytree(hf_dir, d)
    for f in d.glob("model*.safetensors*"):
        f.unlink()
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    cfg = {**json.loads((hf_dir / "config.json").read_text()), "architectures": ["LlamaForCausalLM"],
           "rope_theta": 500000.0, "rope_scaling": scaling}
    (d / "config.json").write_text(json.dumps(cfg))
    mc = ModelConfig.from_hf(cfg)
    w = random_weights(mc, seed=4)
    _raw_bf16_safetensors(d / "model.safetensors", w)
    ck = load_hf_checkpoint(d)
    assert ck.config.rope_freqs
    # HF: inv_freq scaled per band, smooth between (transformers' modeling_rope_utils)
    dim, base = mc.head_dim, 500000.0
    inv = [1.0 / base ** (i / dim) for i in range(0, dim, 2)]
    low_wl, high_wl = 64 / 1.0, 64 / 4.0
    scaled = []
    for f in inv:
        wl = 2 * math.pi / f
        if wl < high_wl:
            scaled.append(f)
        elif wl > low_wl:
            scaled.append(f / 8.0)
        else:
            s = (64 / wl - 1.0) / (4.0 - 1.0)
            scaled.append((1 - s) * f / 8.0 + s * f)
    want = np.array([a / b for a, b in zip(inv, scaled)], dtype=np.float32)
    assert np.allclose(ck.weights[ROPE_FREQS], want, rtol=1e-6)
    assert 1.0 in ck.weights[ROPE_FREQS] and 8.0 in ck.weights[ROPE_FREQS]  # both bands occur
    vp = _pack_and_check_golden(d, ck, tmp_path)
    assert vp.manifest.model.rope_freqs
    np.testing.assert_array_equal(vp.weights()[ROPE_FREQS], ck.weights[ROPE_FREQS])  # F32 kept
    (d / "config.json").write_text(json.dumps({**cfg, "rope_scaling": {"type": "yarn", "factor": 2}}))
    with pytest.raises(ValidationError, match="rope_scaling 'yarn'"):
        load_hf_checkpoint(d)


def test_hf_llama_linear_rope_scaling(hf_dir: Path, tmp_path: Path) -> None:
    """``rope_scaling: {"type": "linear", "factor": 4}`` (older Llama fine-tunes; "rope_type" the
    newer spelling) is ``rope_scaling_factor`` 4 — every RoPE frequency divided by it, no divisor
    tensor —; golden tokens equal the reference's and the runtime's; the factor changes the
    logits; a factor that is no number > 0 is refused naming the key."""
    import shutil

    from calserve.runtime.reference import ReferenceModel

    d = tmp_path / "linear"
    shutil.copytree(hf_dir, d)
    for f in d.glob("model*.safetensors*"):
        f.unlink()
    cfg = {**json.loads((hf_dir / "config.json").read_text()), "architectures": ["LlamaForCausalLM"],
           "rope_scaling": {"type": "linear", "factor": 4.0}}
    (d / "config.json").write_text(json.dumps(cfg))
    mc = ModelConfig.from_hf(cfg)
    w = random_weights(mc, seed=5)
    _raw_bf16_safetensors(d / "model.safetensors", w)
    ck = load_hf_checkpoint(d)
    assert ck.config.rope_scaling_factor == 4.0 and not ck.config.rope_freqs
    assert "model.rope_freqs.weight" not in ck.weights
    vp = _pack_and_check_golden(d, ck, tmp_path)
    assert vp.manifest.model.rope_scaling_factor == 4.0
    prompt = [5, 17, 99, 3, 250, 41, 8, 77]
    scaled = ReferenceModel(ck.config, ck.weights).forward(prompt)[-1]
    plain = ReferenceModel(mc, ck.weights).forward(prompt)[-1]
    assert np.abs(scaled - plain).max() > 1e-2
    newer = {"rope_type": "linear", "factor": 4.0}
    (d / "config.json").write_text(json.dumps({**cfg, "rope_scaling": newer}))
    assert load_hf_checkpoint(d).config == ck.config
    for bad in ({"type": "linear"}, {"type": "linear", "factor": -1.0},
                {"rope_type": "linear", "factor": None}):
        (d / "config.json").write_text(json.dumps({**cfg, "rope_scaling": bad}))
        with pytest.raises(ValidationError, match=r"rope_scaling\.factor"):
            load_hf_checkpoint(d)
