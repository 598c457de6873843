"""``calserve pack --from-gguf`` on small GGUF files this test writes with ``gguf.GGUFWriter``: tensor
names and types, llama.cpp's Q/K row permutation undone, the config and tokenizer from the metadata,
refusals naming the key, and the packed model on the software runtime against a numpy forward in
llama.cpp's layout (tests/gguf_llama.py). The real SmolLM2 file: tests/e2e/test_smollm2.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import tokenizers
from gguf import GGMLQuantizationType as QT
from gguf import quants
from hypothesis import given
from hypothesis import strategies as st

from calserve.errors import ValidationError
from calserve.models.demo_model import demo_tokenizer_json
from calserve.models.gguf_import import SUPPORTED_TYPES, read_gguf, unpermute_rope_rows
from calserve.runtime.reference import ModelConfig, ReferenceModel, random_weights

from gguf_llama import GGUFLlama  # tests/gguf_llama.py (tests/ is on sys.path: its conftest)

from .gguf_check import pack_opened, runtime_matches


def llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py ``LlamaModel.permute`` (written out here for the test)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@given(st.integers(1, 6), st.integers(1, 5), st.integers(1, 4))
def test_unpermute_inverts_llamacpp_permute(n_head: int, half: int, cols: int) -> None:
    w = np.arange(n_head * 2 * half * cols, dtype=np.float32).reshape(n_head * 2 * half, cols)
    assert np.array_equal(unpermute_rope_rows(llamacpp_permute(w, n_head), n_head), w)


_LAYER = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def _gguf_name(hf: str) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    if hf == "model.rope_freqs.weight":
        return "rope_freqs.weight"
    _, _, i, rest = hf.split(".", 3)
    stem, _, kind = rest.rpartition(".")  # kind: weight, or bias (Qwen2's q/k/v)
    return f"blk.{i}.{_LAYER[stem]}.{kind}"


def _k_blocks(kind: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random K-quant blocks with small finite f16 scales (gguf cannot quantize K types)."""
    size = gguf.GGML_QUANT_SIZES[QT[kind]][1]
    raw = rng.integers(0, 256, (rows, cols // 256, size), dtype=np.uint8)
    scale = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    if kind == "Q6_K":
        raw[..., size - 2 : size] = scale  # d is the last field
    else:
        raw[..., 0:2] = scale  # d, dmin first
        raw[..., 2:4] = np.frombuffer(np.float16(0.002).tobytes(), np.uint8)
    return raw.reshape(rows, -1)


def write_gguf(path: Path, cfg: ModelConfig, w: dict[str, np.ndarray], *, arch: str = "llama",
               types: dict[str, str] | None = None, meta: dict[str, Any] | None = None,
               rng: np.random.Generator | None = None) -> dict[str, np.ndarray]:
    """Write the HF-layout weights ``w`` as llama.cpp would (permuted Q/K for llama) and return the
    float weights the file then holds, in HF layout (what an exact import must give back)."""
    rng = rng or np.random.default_rng(0)
    tj = __import__("json").loads(demo_tokenizer_json())
    vocab = sorted(tj["model"]["vocab"].items(), key=lambda kv: kv[1])
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    special = {t["id"] for t in tj["added_tokens"]}
    wr = gguf.GGUFWriter(str(path), arch)
    kv: dict[str, Any] = {
        f"{arch}.block_count": cfg.num_hidden_layers, f"{arch}.embedding_length": cfg.hidden_size,
        f"{arch}.feed_forward_length": cfg.intermediate_size,
        f"{arch}.attention.head_count": cfg.num_attention_heads,
        f"{arch}.attention.head_count_kv": cfg.num_key_value_heads,
        f"{arch}.attention.layer_norm_rms_epsilon": cfg.rms_norm_eps,
        f"{arch}.rope.freq_base": cfg.rope_theta, f"{arch}.context_length": 256,
    }
    if cfg.head_dim * cfg.num_attention_heads != cfg.hidden_size:
        kv[f"{arch}.attention.key_length"] = cfg.head_dim
    kv.update({k: v for k, v in (meta or {}).items() if k != "pre"})
    for k, v in kv.items():
        if v is None:
            continue
        if isinstance(v, bool) or isinstance(v, str):
            (wr.add_bool if isinstance(v, bool) else wr.add_string)(k, v)  # type: ignore[operator]
        elif isinstance(v, int):
            wr.add_uint32(k, v)
        else:
            wr.add_float32(k, float(v))
    wr.add_string("tokenizer.ggml.model", "gpt2")
    wr.add_string("tokenizer.ggml.pre", (meta or {}).get("pre", "gpt2"))
    wr.add_array("tokenizer.ggml.tokens", [t for t, _ in vocab])
    wr.add_array("tokenizer.ggml.token_type", [3 if i in special else 1 for _, i in vocab])
    wr.add_array("tokenizer.ggml.merges", merges)
    wr.add_uint32("tokenizer.ggml.eos_token_id", max(special))
    wr.add_bool("tokenizer.ggml.add_bos_token", False)
    wr.add_string("tokenizer.chat_template", "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    held: dict[str, np.ndarray] = {}
    if arch == "phi3":  # Phi-3's fused tensors, as its converter writes them (F32 only here)
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            q, k, v = (w[p + f"self_attn.{x}_proj.weight"] for x in "qkv")
            gate, up = w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]
            wr.add_tensor(f"blk.{i}.attn_qkv.weight", np.ascontiguousarray(np.concatenate([q, k, v])))
            wr.add_tensor(f"blk.{i}.ffn_up.weight", np.ascontiguousarray(np.concatenate([gate, up])))
            held.update({p + f"self_attn.{x}_proj.weight": a for x, a in zip("qkv", (q, k, v))})
            held.update({p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up})
        w = {n: a for n, a in w.items() if n not in held}
    for name, a in w.items():
        heads = {"q_proj": cfg.num_attention_heads, "k_proj": cfg.num_key_value_heads}
        perm = next((h for k, h in heads.items() if k in name), None) if arch == "llama" else None
        g = llamacpp_permute(a, perm) if perm else a
        kind = (types or {}).get(name, "F32")
        if a.ndim == 1 or kind == "F32":
            wr.add_tensor(_gguf_name(name), np.ascontiguousarray(g, np.float32))
            back = g
        elif kind == "F16":
            wr.add_tensor(_gguf_name(name), g.astype(np.float16))
            back = g.astype(np.float16).astype(np.float32)
        else:
            q = _k_blocks(kind, *g.shape, rng) if kind.endswith("_K") else quants.quantize(g, QT[kind])
            wr.add_tensor(_gguf_name(name), q, raw_dtype=QT[kind])
            back = quants.dequantize(q, QT[kind]).reshape(g.shape)
        held[name] = unpermute_rope_rows(back, perm) if perm else np.asarray(back, np.float32)
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    return held


VOCAB = tokenizers.Tokenizer.from_str(demo_tokenizer_json()).get_vocab_size()
TINY = ModelConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-5,
                   rope_theta=100000.0, tie_word_embeddings=True, max_position_embeddings=256,
                   architecture="LlamaForCausalLM")


def reference_greedy(mc: ModelConfig, weights: Any, prompt: list[int], n: int
                     ) -> tuple[list[int], list[float]]:
    """``n`` greedy tokens of the package's reference after ``prompt``, and their logprobs."""
    ref = ReferenceModel(mc, weights)
    logits = ref.forward(prompt)[-1]
    toks: list[int] = []
    lps: list[float] = []
    for _ in range(n):
        z = logits.astype(np.float64)
        toks.append(int(np.argmax(z)))
        lps.append(float(z[toks[-1]] - z.max() - np.log(np.exp(z - z.max()).sum())))
        logits = ref.forward([toks[-1]])[-1]
    return toks, lps


def test_every_supported_type_dequantizes_and_qk_rows_come_back(tmp_path: Path) -> None:
    w = random_weights(TINY, seed=3)
    lay = "model.layers.0."
    types = dict(zip([lay + "self_attn.q_proj.weight", lay + "self_attn.k_proj.weight",
                      lay + "self_attn.v_proj.weight", lay + "self_attn.o_proj.weight",
                      lay + "mlp.gate_proj.weight", lay + "mlp.up_proj.weight",
                      lay + "mlp.down_proj.weight", "model.embed_tokens.weight"],
                     ["Q4_K", "Q5_K", "Q6_K", "Q4_0", "Q4_1", "Q8_0", "BF16", "F16"]))
    held = write_gguf(tmp_path / "t.gguf", TINY, w, types=types)
    m = read_gguf(tmp_path / "t.gguf")
    assert m.config == TINY
    assert set(m.tensor_types.values()) == set(SUPPORTED_TYPES)
    for name, want in held.items():
        assert m.weights[name].dtype == np.float32 and np.array_equal(m.weights[name], want), name
    # The quantizable types stay within their quantization error of the original floats (the K
    # types hold random blocks: only the library's own decoding is expected there).
    for name, kind in types.items():
        if not kind.endswith("_K"):
            tol = {"Q4_0": 0.2, "Q4_1": 0.2, "Q8_0": 0.02, "BF16": 0.01, "F16": 0.001}[kind]
            err = np.abs(m.weights[name] - w[name]).max() / np.abs(w[name]).max()
            assert err < tol, (name, kind, err)


_HF_ARCH = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "phi3": "LlamaForCausalLM"}


@pytest.mark.parametrize(("arch", "tied"), [("llama", True), ("llama", False), ("qwen2", True),
                                            ("qwen2", False), ("phi3", False), ("llama31", True)])
def test_packed_tiny_llama_computes_what_llamacpp_layout_computes(tmp_path: Path, arch: str,
                                                                  tied: bool) -> None:
    """A Llama (Q/K permuted in the file, llama.cpp's normal RoPE), a Qwen2 (not permuted, neox
    RoPE, q/k/v biases), a Phi-3 (fused q/k/v and gate/up, neox RoPE, a sliding window) and a
    Llama 3.1 (its rope_freqs divisors) packed from GGUF compute what tests/gguf_llama.py computes
    from the file."""
    llama31 = arch == "llama31"
    arch = "llama" if llama31 else arch
    cfg = ModelConfig(**{**TINY.to_dict(), "tie_word_embeddings": tied, "architecture": _HF_ARCH[arch],
                         "rope_freqs": llama31})
    w = random_weights(cfg, seed=5)
    meta = {"qwen2": {"pre": "qwen2"}, "phi3": {"phi3.attention.sliding_window": 100}}.get(arch)
    write_gguf(tmp_path / "t.gguf", cfg, w, arch=arch, meta=meta,
               types={"model.layers.1.self_attn.q_proj.weight": "Q4_1",
                      "model.layers.1.self_attn.k_proj.weight": "Q8_0"})
    vp = pack_opened(tmp_path / "t.gguf", tmp_path)
    assert vp.manifest.model.architecture == _HF_ARCH[arch]
    assert vp.manifest.model.rope_freqs is llama31
    assert vp.manifest.model.tie_word_embeddings is tied
    # the whole context; Phi-3's window on every layer
    assert vp.manifest.model.max_position_embeddings == 256
    assert vp.manifest.model.sliding_window == (100 if arch == "phi3" else 0)
    assert vp.manifest.model.sliding_window_pattern == 0
    assert all(p.max_seq <= vp.manifest.model.max_position_embeddings for p in vp.manifest.profiles)
    assert vp.manifest.chat_template == "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    runtime_matches(GGUFLlama(tmp_path / "t.gguf"), vp.manifest.model_config(), vp.weights(),
                    [5, 17, 99, 3, 250])


def test_qwen3_gguf_is_not_permuted_and_keeps_qk_norm(tmp_path: Path) -> None:
    cfg = ModelConfig(**{**TINY.to_dict(), "architecture": "Qwen3ForCausalLM", "head_dim": 32})
    w = random_weights(cfg, seed=9)
    write_gguf(tmp_path / "q.gguf", cfg, w, arch="qwen3", meta={"pre": "qwen2"})
    m = read_gguf(tmp_path / "q.gguf")
    assert m.config == cfg
    for name, a in w.items():
        assert np.array_equal(m.weights[name], a), name


@pytest.mark.parametrize(
    ("arch", "meta", "types", "names"),
    [
        ("gpt2", {}, {}, "general.architecture"),
        ("llama", {"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0}, {},
         "llama.rope.scaling.type"),
        ("llama", {"llama.rope.scaling.type": "linear"}, {}, "llama.rope.scaling.factor"),
        ("llama", {"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 0.0}, {},
         "llama.rope.scaling.factor"),
        ("qwen2", {"pre": "qwen2", "qwen2.rope.scaling.type": "linear", "qwen2.rope.scaling.factor": -2.0},
         {}, "qwen2.rope.scaling.factor"),
        ("llama", {"llama.rope.scale_linear": -4.0}, {}, "llama.rope.scale_linear"),
        ("llama", {"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0,
                   "llama.rope.scaling.attn_factor": 0.5}, {}, "llama.rope.scaling.attn_factor"),
        ("llama", {"pre": "no-such-pre"}, {}, "tokenizer.ggml.pre"),
        ("llama", {"llama.rope.dimension_count": 32}, {}, "llama.rope.dimension_count"),
        ("llama", {}, {"model.layers.0.mlp.up_proj.weight": "Q5_0"}, "Q5_0"),
    ],
)
def test_refusals_name_the_key(tmp_path: Path, arch: str, meta: dict[str, Any],
                               types: dict[str, str], names: str) -> None:
    w = random_weights(TINY, seed=1)
    write_gguf(tmp_path / "bad.gguf", TINY, w, arch=arch, meta=meta, types=types)
    with pytest.raises(ValidationError, match=names.replace(".", r"\.")):
        read_gguf(tmp_path / "bad.gguf")


def test_linear_rope_scaling(tmp_path: Path) -> None:
    """A Llama GGUF with ``llama.rope.scaling.type`` "linear", factor 4 (a SuperHOT / LongChat-style
    long-context Llama): ``rope_scaling_factor`` 4 on every layer; on a 24-token prompt then 6
    greedy steps the package's reference gives the tokens of tests/gguf_llama.py (freq_scale 1/4,
    Q/K rows permuted in the file) with logprobs within 1e-3, the software runtime its logits
    within 1e-4 (relative), and unscaled the logprobs differ."""

    cfg = ModelConfig(**{**TINY.to_dict(), "tie_word_embeddings": False})
    write_gguf(tmp_path / "l.gguf", cfg, random_weights(cfg, seed=6),
               meta={"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0})
    vp = pack_opened(tmp_path / "l.gguf", tmp_path)
    mc = vp.manifest.model_config()
    assert mc.rope_scaling_factor == 4.0 and not mc.rope_freqs
    assert [mc.layer_rope_factor(i) for i in range(2)] == [4.0, 4.0]
    prompt = [5, 17, 99, 3, 250, 41, 8, 77, 120, 64, 2, 31, 9, 140, 66, 23, 88, 5, 210, 34, 12, 70, 150, 6]
    want_toks, want_lps, _ = GGUFLlama(tmp_path / "l.gguf").greedy(prompt, 6)
    toks, lps = reference_greedy(mc, vp.weights(), prompt, 6)
    assert toks == want_toks and np.allclose(lps, want_lps, atol=1e-3), (toks, want_toks, lps, want_lps)
    unscaled = GGUFLlama(tmp_path / "l.gguf")
    unscaled.freq_scale = 1.0
    assert not np.allclose(unscaled.greedy(prompt, 1)[1], want_lps[:1], atol=1e-3)  # it matters
    runtime_matches(GGUFLlama(tmp_path / "l.gguf"), mc, vp.weights(), prompt, want_toks[:1])


@pytest.mark.parametrize(("meta", "factor"), [
    ({"llama.rope.scaling.factor": 2.5}, 2.5),  # no type: llama.cpp's default is "linear"
    ({"llama.rope.scale_linear": 2.0}, 2.0),  # the older key
    ({"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 1.1}, 1.1),  # float32 1.1
    ({"llama.rope.scaling.type": "none", "llama.rope.scaling.factor": 4.0}, 0.0),  # "none" never scales
    ({"llama.rope.scaling.type": "none"}, 0.0),
])
def test_linear_rope_scaling_keys_read_as_llamacpp_reads_them(tmp_path: Path, meta: dict[str, Any],
                                                              factor: float) -> None:
    write_gguf(tmp_path / "l.gguf", TINY, random_weights(TINY, seed=1), meta=meta)
    assert read_gguf(tmp_path / "l.gguf").config.rope_scaling_factor == factor
    g = GGUFLlama(tmp_path / "l.gguf")
    assert g.freq_scale == pytest.approx(1 / factor if factor else 1.0, rel=1e-6)


@pytest.mark.parametrize(("arch", "extra"), [("llama", "model.layers.0.self_attn.q_proj.bias"),
                                             ("qwen2", "model.layers.1.self_attn.o_proj.bias")])
def test_biases_other_than_qwen2s_are_refused(tmp_path: Path, arch: str, extra: str) -> None:
    cfg = ModelConfig(**{**TINY.to_dict(), "architecture": _HF_ARCH[arch]})
    w = random_weights(cfg, seed=1)
    w[extra] = np.ones(w[extra.replace(".bias", ".weight")].shape[0], np.float32)
    write_gguf(tmp_path / "b.gguf", cfg, w, arch=arch)
    with pytest.raises(ValidationError, match=f"{extra.replace('.', '[.]')} does not belong to a "
                                              f"{_HF_ARCH[arch]}"):
        read_gguf(tmp_path / "b.gguf")


def test_not_a_gguf_file(tmp_path: Path) -> None:
    (tmp_path / "x.gguf").write_bytes(b"not a gguf at all")
    with pytest.raises(ValidationError, match="x.gguf"):
        read_gguf(tmp_path / "x.gguf")
    with pytest.raises(ValidationError, match="no installed Python package"):
        read_gguf("pkg:no_such_pkg_xyz/a.gguf")


def test_cli_pack_from_gguf_bf16_then_verify(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from calserve.cli import main
    from calserve.models.hf import tensor_index

    write_gguf(tmp_path / "t.gguf", TINY, random_weights(TINY, seed=2))
    key = tmp_path / "k"
    assert main(["keygen", "--out", str(key)]) == 0
    out = tmp_path / "pkg"
    assert main(["pack", "--from-gguf", str(tmp_path / "t.gguf"), "--out", str(out), "--key", str(key),
                 "--profiles", "1,4", "--dtype", "BF16"]) == 0
    assert {dt for dt, _ in tensor_index(out / "model.safetensors").values()} == {"BF16"}
    assert main(["verify", str(out), "--trusted-key", str(key) + ".pub", "--runtime", "sim-next"]) == 0
    assert main(["pack", "--from-gguf", str(tmp_path / "missing.gguf"), "--out", str(tmp_path / "p2"),
                 "--key", str(key)]) == 1
    assert "missing.gguf" in capsys.readouterr().err


def test_phi3_window_past_its_length(tmp_path: Path) -> None:
    """A Phi-3 with a 4-token window, on a 12-token prompt then decode steps: the package's
    reference and the software runtime compute what tests/gguf_llama.py computes with the window
    (and not what it computes without it)."""

    cfg = ModelConfig(**{**TINY.to_dict(), "tie_word_embeddings": False})
    write_gguf(tmp_path / "p.gguf", cfg, random_weights(cfg, seed=8), arch="phi3",
               meta={"phi3.attention.sliding_window": 4})
    vp = pack_opened(tmp_path / "p.gguf", tmp_path)
    mc = vp.manifest.model_config()
    assert (mc.sliding_window, mc.sliding_window_pattern, mc.max_position_embeddings) == (4, 0, 256)
    prompt = [5, 17, 99, 3, 250, 41, 8, 77, 120, 64, 2, 31]
    want_toks, want_lps, _ = GGUFLlama(tmp_path / "p.gguf").greedy(prompt, 6)
    toks, lps = reference_greedy(mc, vp.weights(), prompt, 6)
    assert toks == want_toks and np.allclose(lps, want_lps, atol=1e-3)
    full = GGUFLlama(tmp_path / "p.gguf")
    full.window = 0
    assert not np.allclose(full.greedy(prompt, 1)[1], want_lps[:1], atol=1e-3)  # the window matters
    runtime_matches(GGUFLlama(tmp_path / "p.gguf"), mc, vp.weights(), prompt, want_toks[:-1])
