"""``calserve pack --from-gguf`` on a small Gemma 3 GGUF this test writes as llama.cpp's converter
does (``general.architecture`` "gemma3", norm weights stored as the multiplier 1 + w, a
SentencePiece vocabulary without a space prefix, ``<end_of_turn>`` a control token).

The package's numpy reference must compute what :class:`LlamaCppGemma3` computes: a forward pass
written here from llama.cpp's gemma3 graph (src/models/gemma3.cpp and load_hparams' LLM_ARCH_GEMMA3)
that shares no code with the importer or calserve.runtime.reference — the embedding times
sqrt(n_embd), attn_norm, per-head q/k norms, neox RoPE with the global base or, on a sliding
layer (``il % 6 < 5``), 10,000, Q times 1/sqrt(head_dim) (1/sqrt(n_embd / n_head) for the 27B),
a key at p0 masked from a query at p1 when p1 - p0 >= n_swa on a sliding layer, attn_post_norm
before the residual add, ffn_norm, GELU (tanh) gate times up, ffn_post_norm before the add,
output_norm and the tied head. The prompts are longer than the window, so the window matters
(checked). Also: the config llama.cpp hard-codes, refusals naming the key, the tokenizer's
specials, and (once calrt-sim computes Gemma 3) the software runtime against the same forward.

The 4B and up: ``gemma3.rope.scaling.type`` "linear" with ``gemma3.rope.scaling.factor`` 8, which
llama.cpp reads as ``freq_scale`` = 1/8 (load_hparams) and applies to the global layers only
(``rope_freq_scale_train_swa`` = 1 for gemma3; ``get_rope_freq_scale`` per layer): the forward
here multiplies those layers' RoPE angles by it, on a longer prompt and decode steps past it.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import tokenizers

from calserve.errors import ValidationError
from calserve.models.gguf_import import read_gguf
from calserve.runtime.reference import ReferenceModel

from .gguf_check import pack_opened, runtime_matches

# --- a SentencePiece vocabulary laid out as Gemma 3's (ids 0-3 <pad> <eos> <bos> <unk>, the turn
# markers at 105/106, then byte pieces and normal pieces with scores) -----------------------------
_CONTROL, _NORMAL, _UNKNOWN, _BYTE = 3, 1, 2, 6
_PIECES = ["\u2581", *"abcdefghijklmnopqrstuvwxyz", "\n", "th", "he", "\u2581t", "\u2581the", "in",
           "er", "an", "\u2581a", "ll", "lo", "llo", "\u2581w", "or", "ld", "orld", "\u2581wo",
           "\u2581world", "\u2581i", "is", "\u2581is"]


def _vocab() -> tuple[list[str], list[int], list[float]]:
    toks = ["<pad>", "<eos>", "<bos>", "<unk>"] + [f"<unused{i}>" for i in range(101)]
    toks += ["<start_of_turn>", "<end_of_turn>"]
    types = [_CONTROL, _CONTROL, _CONTROL, _UNKNOWN] + [_CONTROL] * 103
    toks += [f"<0x{b:02X}>" for b in range(256)]
    types += [_BYTE] * 256
    scores = [0.0] * len(toks)
    for i, p in enumerate(_PIECES):  # longer merges score lower, as SentencePiece's ranks do
        toks.append(p)
        types.append(_NORMAL)
        scores.append(-float(i))
    return toks, types, scores


TOKENS, TYPES, SCORES = _vocab()
EOS, BOS, SOT, EOT = 1, 2, 105, 106
# every 6th layer global: 7 layers = five sliding, one global (5), one sliding (6)
DIMS = {"hidden": 64, "ff": 128, "layers": 7, "heads": 4, "kv": 2, "head_dim": 32, "window": 4}


def write_gemma3_gguf(path: Path, dims: dict[str, int] | None = None, *, seed: int = 0,
                      meta: dict[str, Any] | None = None, extra_tensors: tuple[str, ...] = (),
                      f16: bool = True, arch: str = "gemma3") -> None:
    """A gemma3 GGUF as convert_hf_to_gguf.py's Gemma3Model writes one (norms as 1 + w, tied);
    ``arch`` "gemma2": as its Gemma2Model writes one (no q/k norms, both soft-caps, one RoPE
    base). A ``meta`` value None leaves that key out."""
    d = {**DIMS, **(dims or {})}
    rng = np.random.default_rng(seed)
    h, hd, nh, kv = d["hidden"], d["head_dim"], d["heads"], d["kv"]
    wr = gguf.GGUFWriter(str(path), arch)
    kvs: dict[str, Any] = {f"{arch}.{k}": v for k, v in {
        "context_length": 256, "embedding_length": h, "block_count": d["layers"],
        "feed_forward_length": d["ff"], "attention.head_count": nh, "attention.head_count_kv": kv,
        "attention.key_length": hd, "attention.value_length": hd,
        "attention.sliding_window": d["window"], "attention.layer_norm_rms_epsilon": 1e-6,
        "rope.freq_base": 1_000_000.0 if arch == "gemma3" else 10_000.0}.items()}
    if arch == "gemma2":
        kvs.update({"gemma2.attn_logit_softcapping": 50.0, "gemma2.final_logit_softcapping": 30.0})
    for k, v in {**kvs, **(meta or {})}.items():
        if v is None:
            continue
        if isinstance(v, str):
            wr.add_string(k, v)
        else:
            (wr.add_float32 if isinstance(v, float) else wr.add_uint32)(k, v)
    wr.add_string("tokenizer.ggml.model", "llama")
    wr.add_string("tokenizer.ggml.pre", "default")
    wr.add_array("tokenizer.ggml.tokens", TOKENS)
    wr.add_array("tokenizer.ggml.scores", SCORES)
    wr.add_array("tokenizer.ggml.token_type", TYPES)
    wr.add_uint32("tokenizer.ggml.bos_token_id", BOS)
    wr.add_uint32("tokenizer.ggml.eos_token_id", EOS)
    wr.add_uint32("tokenizer.ggml.unknown_token_id", 3)
    wr.add_uint32("tokenizer.ggml.padding_token_id", 0)
    wr.add_bool("tokenizer.ggml.add_bos_token", True)
    wr.add_bool("tokenizer.ggml.add_eos_token", False)
    wr.add_bool("tokenizer.ggml.add_space_prefix", False)
    wr.add_string("tokenizer.chat_template",
                  "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n"
                  "{{ m['content'] }}<end_of_turn>\n{% endfor %}")

    def mat(rows: int, cols: int, scale: float | None = None) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * (scale or 1 / math.sqrt(cols))).astype(np.float32)

    def norm(n: int) -> np.ndarray:  # the multiplier 1 + w, as the converter stores it
        return (1.0 + 0.2 * rng.standard_normal(n)).astype(np.float32)

    def add(name: str, a: np.ndarray) -> None:
        # 2-D tensors as F16 now and then (the converter's default for matrices), 1-D always F32
        wr.add_tensor(name, a.astype(np.float16) if f16 and a.ndim == 2 and rng.random() < 0.5 else a)

    add("token_embd.weight", mat(len(TOKENS), h, 0.1))
    for i in range(d["layers"]):
        p = f"blk.{i}."
        add(p + "attn_norm.weight", norm(h))
        add(p + "attn_q.weight", mat(nh * hd, h))
        add(p + "attn_k.weight", mat(kv * hd, h))
        add(p + "attn_v.weight", mat(kv * hd, h))
        if arch == "gemma3":
            add(p + "attn_q_norm.weight", norm(hd))
            add(p + "attn_k_norm.weight", norm(hd))
        add(p + "attn_output.weight", mat(h, nh * hd))
        add(p + "post_attention_norm.weight", norm(h))
        add(p + "ffn_norm.weight", norm(h))
        add(p + "ffn_gate.weight", mat(d["ff"], h))
        add(p + "ffn_up.weight", mat(d["ff"], h))
        add(p + "ffn_down.weight", mat(h, d["ff"]))
        add(p + "post_ffw_norm.weight", norm(h))
    add("output_norm.weight", norm(h))
    for name in extra_tensors:
        wr.add_tensor(name, np.zeros((4, 4), np.float32))
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()


class LlamaCppGemma3:
    """llama.cpp's gemma3 graph in numpy, one token at a time (module docstring); a gemma2 file:
    its gemma2 graph (src/models/gemma2.cpp, load_hparams' LLM_ARCH_GEMMA2): no q/k norms, every
    other layer sliding (``il % 2 < 1``), one RoPE base, Q times the same scale, each score
    ``c * tanh(kq / c)`` before the mask (hparams.attn_soft_cap), the output logits the same with
    the final cap."""

    def __init__(self, path: Path, *, window: bool = True, scaling: bool = True,
                 scale_swa: bool = False, softcap: bool = True) -> None:
        """``window``/``scaling``/``softcap`` False: as if the file had no window/RoPE scaling/
        soft-caps; ``scale_swa``: as if the sliding layers were scaled too (not llama.cpp's
        gemma3: counterfactuals)."""
        r = gguf.GGUFReader(str(path))
        self.arch = arch = str(r.fields["general.architecture"].contents())
        a = arch

        def meta(k: str) -> Any:
            return r.fields[k.replace("gemma3.", f"{a}.", 1)].contents()

        def opt(k: str, default: float) -> float:
            return float(meta(k)) if k.replace("gemma3.", f"{a}.", 1) in r.fields else default

        gemma2 = arch == "gemma2"
        self.pattern = 2 if gemma2 else 6  # hparams.set_swa_pattern
        self.attn_cap = opt("gemma3.attn_logit_softcapping", 50.0) if gemma2 and softcap else 0.0
        self.final_cap = opt("gemma3.final_logit_softcapping", 30.0) if gemma2 and softcap else 0.0

        # load_hparams: rope.scaling.type (default "linear"), freq_scale = 1 / rope.scaling.factor
        # (absent: 1); llama_context: type "none" never scales
        kind = meta("gemma3.rope.scaling.type") if f"{a}.rope.scaling.type" in r.fields else "linear"
        factor = opt("gemma3.rope.scaling.factor", 0.0)
        assert kind in ("none", "linear"), kind
        self.freq_scale = 1.0 if kind == "none" or factor == 0.0 or not scaling else 1.0 / factor
        self.scale_swa = scale_swa

        self.n_layer = int(meta("gemma3.block_count"))
        self.n_head = int(meta("gemma3.attention.head_count"))
        self.n_kv = int(meta("gemma3.attention.head_count_kv"))
        self.n_embd = int(meta("gemma3.embedding_length"))
        self.d = int(meta("gemma3.attention.key_length"))
        self.eps = float(meta("gemma3.attention.layer_norm_rms_epsilon"))
        self.base = float(meta("gemma3.rope.freq_base"))
        # gemma3: 10,000 on the sliding layers; gemma2: the one base (freq_base_swa if a file has it)
        self.swa_base = opt("gemma3.rope.freq_base_swa", self.base) if gemma2 else 10000.0
        self.n_swa = int(opt("gemma3.attention.sliding_window", 4096)) if window else 0
        # llama.cpp: f_attention_scale = 1/sqrt(27B ? n_embd / n_head : n_embd_head_k)
        big = self.n_layer == (46 if gemma2 else 62)
        self.kq_scale = 1.0 / math.sqrt(self.n_embd // self.n_head if big else self.d)
        self.t: dict[str, np.ndarray] = {}
        for t in r.tensors:  # F32 / F16 only here: the reader's arrays are the values
            shape = tuple(int(x) for x in reversed(t.shape.tolist()))
            self.t[t.name] = np.asarray(t.data, dtype=np.float32).reshape(shape)
        self.k: list[list[np.ndarray]] = [[] for _ in range(self.n_layer)]
        self.v: list[list[np.ndarray]] = [[] for _ in range(self.n_layer)]

    def _norm(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:  # over the last axis
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.eps) * w

    def _swa(self, il: int) -> bool:  # hparams.set_swa_pattern(n): il % n < n - 1 slides
        return self.n_swa > 0 and il % self.pattern < self.pattern - 1

    def _cap(self, x: np.ndarray, c: float) -> np.ndarray:  # ggml_scale, ggml_tanh, ggml_scale
        return (np.tanh(x * np.float32(1.0 / c)) * np.float32(c)).astype(np.float32) if c else x

    def _rope_neox(self, x: np.ndarray, pos: int, base: float, freq_scale: float) -> np.ndarray:
        d = self.d
        theta = freq_scale * pos * base ** (-np.arange(0, d, 2, dtype=np.float64) / d)
        c, s = np.cos(theta).astype(np.float32), np.sin(theta).astype(np.float32)
        a, b = x[:, : d // 2], x[:, d // 2 :]
        return np.concatenate([a * c - b * s, a * s + b * c], axis=1)

    def step(self, token: int) -> np.ndarray:
        t, H, KV, D = self.t, self.n_head, self.n_kv, self.d
        p1 = len(self.k[0])
        x = t["token_embd.weight"][token] * np.float32(math.sqrt(self.n_embd))
        for il in range(self.n_layer):
            p = f"blk.{il}."
            cur = self._norm(x, t[p + "attn_norm.weight"])
            q = (t[p + "attn_q.weight"] @ cur).reshape(H, D)
            k = (t[p + "attn_k.weight"] @ cur).reshape(KV, D)
            v = (t[p + "attn_v.weight"] @ cur).reshape(KV, D)
            base = self.swa_base if self._swa(il) else self.base  # rope_freq_base_train_swa
            # gemma3: rope_freq_scale_train_swa = 1, a sliding layer is never scaled
            fs = 1.0 if self._swa(il) and not self.scale_swa and self.arch == "gemma3" \
                else self.freq_scale
            if p + "attn_q_norm.weight" in t:  # gemma3
                q, k = self._norm(q, t[p + "attn_q_norm.weight"]), self._norm(k, t[p + "attn_k_norm.weight"])
            q = self._rope_neox(q, p1, base, fs) * self.kq_scale
            k = self._rope_neox(k, p1, base, fs)
            self.k[il].append(k)
            self.v[il].append(v)
            K, V = np.stack(self.k[il]), np.stack(self.v[il])  # [S, KV, D]
            masked = np.array([self._swa(il) and p1 - p0 >= self.n_swa for p0 in range(p1 + 1)])
            att = np.empty((H, D), np.float32)
            for hh in range(H):
                g = hh // (H // KV)
                kq = np.where(masked, -np.inf, self._cap(K[:, g, :] @ q[hh], self.attn_cap))
                w = np.exp(kq - kq.max())
                att[hh] = (w / w.sum()) @ V[:, g, :]
            cur = self._norm(t[p + "attn_output.weight"] @ att.reshape(-1),
                             t[p + "post_attention_norm.weight"])
            sa_out = cur + x
            cur = self._norm(sa_out, t[p + "ffn_norm.weight"])
            gate, up = t[p + "ffn_gate.weight"] @ cur, t[p + "ffn_up.weight"] @ cur
            g64 = gate.astype(np.float64)  # ggml_gelu: the tanh approximation
            gelu = 0.5 * g64 * (1 + np.tanh(math.sqrt(2 / math.pi) * (g64 + 0.044715 * g64 ** 3)))
            cur = t[p + "ffn_down.weight"] @ (gelu.astype(np.float32) * up)
            x = self._norm(cur, t[p + "post_ffw_norm.weight"]) + sa_out
        out = np.asarray(t["token_embd.weight"] @ self._norm(x, t["output_norm.weight"]), np.float32)
        return self._cap(out, self.final_cap)

    def greedy(self, prompt: list[int], n: int) -> tuple[list[int], list[float], list[np.ndarray]]:
        """(tokens, their logprobs, the logits of every prompt position) of ``n`` greedy steps."""
        logits = [self.step(tok) for tok in prompt]
        toks, lps = _greedy(logits[-1], n, self.step)
        return toks, lps, logits


def _greedy(logits: np.ndarray, n: int, step: Any) -> tuple[list[int], list[float]]:
    toks, lps = [], []
    for _ in range(n):
        z = logits.astype(np.float64)
        tok = int(np.argmax(z))
        toks.append(tok)
        lps.append(float(z[tok] - (z.max() + np.log(np.exp(z - z.max()).sum()))))
        logits = step(tok)
    return toks, lps


PROMPT = [2, 400, 371, 380, 365, 385, 372, 390, 377, 366, 388, 395]  # 12 tokens > window 4


def pack_gemma3(d: Path, **write: Any) -> tuple[Path, Any]:
    """A gemma3 GGUF (``write_gemma3_gguf``'s arguments) in ``d``, packed and opened: (its path,
    the verified package)."""
    write_gemma3_gguf(d / "g.gguf", **write)
    return d / "g.gguf", pack_opened(d / "g.gguf", d)


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    return pack_gemma3(tmp_path_factory.mktemp("gemma3"))


def test_config_is_what_llamacpp_hardcodes(packed: tuple[Path, Any]) -> None:
    _, vp = packed
    cfg = vp.manifest.model_config()
    assert cfg.architecture == "Gemma3ForCausalLM" and cfg.gemma and cfg.qk_norm
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.head_dim) == (64, 7, 32)
    assert (cfg.sliding_window, cfg.sliding_window_pattern) == (4, 6)
    assert cfg.rope_theta == 1_000_000.0 and cfg.rope_local_theta == 10000.0
    assert cfg.query_pre_attn_scalar == 32.0  # head_dim (not the 27B)
    assert cfg.tie_word_embeddings and cfg.max_position_embeddings == 256
    assert [cfg.sliding(i) for i in range(7)] == [True] * 5 + [False, True]


def reference_matches_llamacpp(path: Path, cfg: Any, weights: Any, prompt: list[int]
                               ) -> list[np.ndarray]:
    """The package's reference (``cfg``, ``weights``) gives llama.cpp's graph's 8 greedy tokens
    after ``prompt``, their logprobs and every prompt position's logits within 1e-3; returns the
    graph's prompt logits."""
    ref = ReferenceModel(cfg, weights)
    logits = ref.forward(prompt)
    got_toks, got_lps = _greedy(logits[-1], 8, lambda t: ref.forward([t])[-1])
    want_toks, want_lps, want_logits = LlamaCppGemma3(path).greedy(prompt, 8)
    assert got_toks == want_toks
    assert np.allclose(got_lps, want_lps, atol=1e-3), (got_lps, want_lps)
    assert np.abs(logits - np.stack(want_logits)).max() < 1e-3
    return want_logits

def test_reference_computes_what_llamacpp_computes(packed: tuple[Path, Any]) -> None:
    """Greedy tokens equal and logprobs within 1e-3 of llama.cpp's graph, on a prompt three times
    the window; the norms are used as stored (no second + 1)."""
    path, vp = packed
    want_logits = reference_matches_llamacpp(path, vp.manifest.model_config(), vp.weights(), PROMPT)
    # the window matters here: without it the last prompt position's logits differ
    full = LlamaCppGemma3(path, window=False).greedy(PROMPT, 1)[2][-1]
    assert np.abs(full - want_logits[-1]).max() > 1e-2


# Gemma 3 4B and up: linear RoPE scaling of the global layers, as convert_hf_to_gguf.py writes it
LINEAR = {"gemma3.rope.scaling.type": "linear", "gemma3.rope.scaling.factor": 8.0}
LONG_PROMPT = [2, *range(371, 402), 380, 365, 385, 372, 390, 377, 366, 388]  # 40 tokens


@pytest.fixture(scope="module")
def packed_linear(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    return pack_gemma3(tmp_path_factory.mktemp("gemma3-linear"), seed=1, meta=LINEAR)


def test_linear_rope_scaling_of_the_global_layers(packed_linear: tuple[Path, Any]) -> None:
    """The 4B+'s linear scaling: factor 8 in the package, the global layer (5) scaled and the
    sliding ones not; on a 40-token prompt (ten windows) then 8 greedy steps the reference gives
    llama.cpp's tokens, logprobs within 1e-3 and prompt logits within 1e-3; the factor matters
    (unscaled, or scaling the sliding layers too, the logits differ)."""
    path, vp = packed_linear
    cfg = vp.manifest.model_config()
    assert cfg.rope_scaling_factor == 8.0 and vp.manifest.model.rope_scaling_factor == 8.0
    assert [cfg.layer_rope_factor(i) for i in range(7)] == [1.0] * 5 + [8.0, 1.0]
    want_logits = reference_matches_llamacpp(path, cfg, vp.weights(), LONG_PROMPT)
    for other in (LlamaCppGemma3(path, scaling=False), LlamaCppGemma3(path, scale_swa=True)):
        z = other.greedy(LONG_PROMPT, 1)[2][-1]
        assert np.abs(z - want_logits[-1]).max() > 1e-2


def test_linear_rope_scaling_on_the_software_runtime(packed_linear: tuple[Path, Any]) -> None:
    """calrt-sim against llama.cpp's graph with the global layers scaled: prefill of 40 tokens,
    then decode steps."""
    runtime_equals_llamacpp(*packed_linear, LONG_PROMPT)


def test_tokenizer_is_gemmas(packed: tuple[Path, Any]) -> None:
    """No space prefix, BOS added, the turn markers matched whole, and <end_of_turn> ends
    generation next to <eos>."""
    path, vp = packed
    m = read_gguf(path)
    st = vp.manifest.special_tokens
    assert st.bos_token_id == BOS and st.add_bos_token and st.bos_token == "<bos>"
    assert st.eos_token_ids[:1] == [EOS] and EOT in st.eos_token_ids
    tok = tokenizers.Tokenizer.from_str(m.tokenizer.tokenizer_json)
    ids = tok.encode("the world").ids
    assert ids[0] == BOS and tok.id_to_token(ids[1]) == "th"  # not "▁the": no prefix
    assert tok.decode(ids, skip_special_tokens=True) == "the world"
    ids = tok.encode("<start_of_turn>user\nhi<end_of_turn>\n", add_special_tokens=False).ids
    assert ids[0] == SOT and EOT in ids and tok.id_to_token(ids[1]) == "u"


def test_the_27b_scales_scores_by_hidden_over_heads(tmp_path: Path) -> None:
    """llama.cpp takes a 62-block gemma3 for the 27B: 1/sqrt(n_embd / n_head), not 1/sqrt(head_dim)."""
    dims = {"hidden": 32, "ff": 16, "layers": 62, "heads": 2, "kv": 1, "head_dim": 8}
    write_gemma3_gguf(tmp_path / "g.gguf", dims, f16=False)
    cfg = read_gguf(tmp_path / "g.gguf").config
    assert cfg.query_pre_attn_scalar == 16.0 and cfg.head_dim == 8
    assert [i for i in range(62) if not cfg.sliding(i)] == list(range(5, 62, 6))


def test_without_a_window_no_layer_slides(tmp_path: Path) -> None:
    """Newer llama.cpp reads gemma3.attention.sliding_window as optional (0: no sliding layer,
    one RoPE base)."""
    write_gemma3_gguf(tmp_path / "g.gguf", {"window": 0, "layers": 2}, f16=False)
    cfg = read_gguf(tmp_path / "g.gguf").config
    assert cfg.sliding_window == 0 and cfg.rope_local_theta == 0.0
    assert not any(cfg.sliding(i) for i in range(2))


@pytest.mark.parametrize(("meta", "tensors", "names"), [
    ({"gemma3.vision.block_count": 2}, (), "gemma3.vision.block_count"),
    ({}, ("v.blk.0.attn_q.weight",), "v.blk.0.attn_q.weight"),
    ({}, ("mm.input_projection.weight",), "mm.input_projection.weight"),
    ({"gemma3.final_logit_softcapping": 30.0}, (), "gemma3.final_logit_softcapping"),
    ({"gemma3.attn_logit_softcapping": 50.0}, (), "gemma3.attn_logit_softcapping"),
    ({"gemma3.attention.value_length": 16}, (), "gemma3.attention.value_length"),
    ({"gemma3.rope.scaling.type": "yarn", "gemma3.rope.scaling.factor": 8.0}, (),
     "gemma3.rope.scaling.type"),
    ({"gemma3.rope.scaling.type": "linear"}, (), "gemma3.rope.scaling.factor"),
    ({"gemma3.rope.scaling.type": "linear", "gemma3.rope.scaling.factor": 0.0}, (),
     "gemma3.rope.scaling.factor"),
    ({"gemma3.rope.scaling.type": "linear", "gemma3.rope.scaling.factor": -8.0}, (),
     "gemma3.rope.scaling.factor"),
])
def test_refusals_name_the_key(tmp_path: Path, meta: dict[str, Any], tensors: tuple[str, ...],
                               names: str) -> None:
    write_gemma3_gguf(tmp_path / "g.gguf", {"layers": 1}, meta=meta, extra_tensors=tensors, f16=False)
    with pytest.raises(ValidationError, match=names.replace(".", r"\.")):
        read_gguf(tmp_path / "g.gguf")


def test_unknown_architecture_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "g.gguf"
    write_gemma3_gguf(path, {"layers": 1}, f16=False)
    raw = path.read_bytes().replace(b"gemma3", b"gemma4")  # every key and the architecture
    (tmp_path / "g2.gguf").write_bytes(raw)
    with pytest.raises(ValidationError, match=r"general\.architecture 'gemma4'"):
        read_gguf(tmp_path / "g2.gguf")


def runtime_equals_llamacpp(path: Path, vp: Any, prompt: list[int]) -> None:
    """calrt-sim's logits of ``prompt`` (prefill) and of 3 greedy decode steps after it equal
    those of llama.cpp's graph (``LlamaCppGemma3``) within 1e-4 of their largest, its greedy
    tokens the graph's."""
    want_toks = LlamaCppGemma3(path).greedy(prompt, 4)[0]
    runtime_matches(LlamaCppGemma3(path), vp.manifest.model_config(), vp.weights(), prompt,
                    want_toks[:-1], greedy=True)


def test_software_runtime_computes_the_same(packed: tuple[Path, Any]) -> None:
    """calrt-sim against llama.cpp's graph: prefill past the window, then decode steps."""
    runtime_equals_llamacpp(*packed, PROMPT)
