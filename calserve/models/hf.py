"""Reading Hugging Face Qwen3/Llama/Qwen2/Gemma 2/Gemma 3 checkpoints without torch, and a tiny safetensors
reader/writer.

``safetensors.numpy`` cannot read BF16 (numpy has no bfloat16), and real Qwen3 checkpoints are BF16,
so the header (8-byte little-endian length + JSON) is parsed here and BF16 is upcast by shifting each
uint16 into the high half of a float32 (exact). F16 and F32 are read as such.

``Gemma3ForCausalLM`` (text only; its tensor names are the other families'): the config's
``rope_local_base_freq`` (the sliding layers' RoPE base), ``sliding_window`` with
``sliding_window_pattern`` (or a ``layer_types`` list of "sliding_attention"/"full_attention"
that is such a pattern) and ``query_pre_attn_scalar`` are kept; absent keys take transformers'
``Gemma3TextConfig`` defaults (tied embeddings among them). The 4B and up scale the global
layers' RoPE linearly (``rope_scaling`` {"rope_type": "linear", "factor": 8}, or the
``rope_parameters.full_attention`` entry so spelled): ``ModelConfig.rope_scaling_factor``, which
leaves the sliding layers (their own base, no scaling, as transformers' local rotary embedding)
alone. Gemma's RMSNorm multiplies by ``1 + weight``: 1 is added to every ``*norm.weight`` on
reading, so the package holds the multiplier as for every family. Refused, naming the key: an
activation other than ``gelu_pytorch_tanh``, logit soft-capping, other ``rope_scaling`` types or a
factor that is no number > 0, a ``rope_parameters`` type other than "default" (and "linear" for
full attention), bidirectional attention, a ``layer_types`` list that is no such pattern.

``Gemma2ForCausalLM`` (2B, 9B, 27B): the same layout without the q/k norms and the sliding layers'
own RoPE base, every other layer global (or as ``layer_types`` says), and logit soft-capping:
``attn_logit_softcapping`` / ``final_logit_softcapping`` (absent: transformers' 50 and 30; null:
none), applied by the runtime; the norms get their 1 as Gemma 3's.

``Gemma3ForConditionalGeneration`` (Gemma 3 4B, 12B, 27B: text and vision): its TEXT model is
imported, as a ``Gemma3ForCausalLM``. The config is ``text_config`` (Gemma3TextConfig's keys and
defaults, as above; ``tie_word_embeddings`` there or at the top level, refused when the two
disagree; EOS/pad/BOS ids from the top level, else ``text_config``). Tensors in either spelling
transformers writes — older ``language_model.model.*`` / ``language_model.lm_head.weight``, newer
``model.language_model.*`` / ``lm_head.weight`` (its ``_checkpoint_conversion_mapping``) — are
renamed to the text model's ``model.*`` / ``lm_head.weight``; ``vision_tower.*`` and
``multi_modal_projector.*`` (with or without ``model.``) are left out unread
(:attr:`HFCheckpoint.note` says so); the embedding keeps every row (the text vocab, 262208 by
default, includes the image tokens). Refused, naming it: no ``text_config`` object, any other
tensor, a tensor spelled both ways.

The other families' ``rope_scaling``: Llama 3.1+'s "llama3" (a divisor per frequency, computed as
llama.cpp's converter does) and "linear" (every frequency divided by ``factor``:
``rope_scaling_factor``); other types refused, naming the key.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from calserve.errors import ValidationError
from calserve.runtime.reference import (
    ARCHITECTURES, GEMMA2, GEMMA3, ROPE_FREQS, ModelConfig, bf16_round, weight_shapes,
)

__all__ = [
    "read_safetensors_header",
    "load_safetensors",
    "write_safetensors",
    "tensor_index",
    "HFCheckpoint",
    "load_hf_checkpoint",
]


_ITEMSIZE = {"BF16": 2, "F16": 2, "F32": 4}
_MAX_HEADER = 100 << 20


def read_safetensors_header(path: str | os.PathLike[str]) -> tuple[dict[str, Any], int]:
    """(header dict without ``__metadata__``, offset of the data section).

    Raises ValidationError naming the file for a truncated/oversized header, an unsupported dtype, or
    offsets that do not match the shape or run past the end of the file.
    """
    p = Path(path)
    size = p.stat().st_size
    with open(p, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValidationError(f"{p.name}: truncated safetensors file (no header length)")
        (n,) = struct.unpack("<Q", head)
        if n > _MAX_HEADER or 8 + n > size:
            raise ValidationError(f"{p.name}: safetensors header length {n} is invalid")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValidationError(f"{p.name}: safetensors header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise ValidationError(f"{p.name}: safetensors header is not an object")
    header.pop("__metadata__", None)
    data_len = size - 8 - n
    for name, info in header.items():
        try:
            dtype, shape, (lo, hi) = info["dtype"], info["shape"], info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise ValidationError(f"{p.name}: tensor {name!r}: malformed header entry") from None
        if dtype not in _ITEMSIZE:
            raise ValidationError(
                f"{p.name}: tensor {name!r} has dtype {dtype}; supported: BF16, F16, F32"
            )
        want = int(np.prod(shape, dtype=np.int64)) * _ITEMSIZE[dtype]
        if not (0 <= lo <= hi <= data_len) or hi - lo != want:
            raise ValidationError(f"{p.name}: tensor {name!r}: data offsets do not match its shape")
    return header, 8 + n


def tensor_index(path: str | os.PathLike[str]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (dtype, shape), header only (cheap; for the static validator)."""
    header, _ = read_safetensors_header(path)
    return {k: (v["dtype"], tuple(int(x) for x in v["shape"])) for k, v in header.items()}


def _to_f32(buf: bytes, dtype: str, shape: list[int]) -> np.ndarray:
    if dtype == "BF16":
        u = np.frombuffer(buf, dtype="<u2").astype(np.uint32) << 16
        arr = u.view(np.float32)
    elif dtype == "F16":
        arr = np.frombuffer(buf, dtype="<f2").astype(np.float32)
    else:
        arr = np.frombuffer(buf, dtype="<f4").astype(np.float32)
    return arr.reshape(shape)


def load_safetensors(
    path: str | os.PathLike[str], keep: Callable[[str], bool] | None = None
) -> dict[str, np.ndarray]:
    """Every tensor (or each one ``keep`` accepts: the others are not read) as float32 (BF16/F16
    upcast exactly)."""
    header, base = read_safetensors_header(path)
    out: dict[str, np.ndarray] = {}
    with open(path, "rb") as f:
        for name, info in header.items():
            if keep is not None and not keep(name):
                continue
            b, e = info["data_offsets"]
            f.seek(base + b)
            out[name] = _to_f32(f.read(e - b), info["dtype"], info["shape"])
    return out


def write_safetensors(
    path: str | os.PathLike[str], tensors: Mapping[str, np.ndarray], dtype: str = "BF16"
) -> None:
    """Write ``tensors`` (float arrays) as ``dtype`` (BF16 rounds to nearest even, F16, F32);
    RoPE's frequency divisors (:data:`ROPE_FREQS`) stay F32 whatever ``dtype`` says (a rounded
    divisor would turn every angle at long positions)."""
    if dtype not in _ITEMSIZE:
        raise ValueError(f"dtype must be one of {sorted(_ITEMSIZE)}, not {dtype!r}")
    blobs: list[bytes] = []
    header: dict[str, Any] = {}
    off = 0
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name], dtype=np.float32)
        kind = "F32" if name == ROPE_FREQS else dtype
        if kind == "BF16":
            raw = (bf16_round(a).view(np.uint32) >> 16).astype("<u2").tobytes()
        elif kind == "F16":
            with np.errstate(over="ignore"):  # beyond the F16 range is inf, as torch writes it
                raw = a.astype("<f2").tobytes()
        else:
            raw = a.astype("<f4").tobytes()
        header[name] = {"dtype": kind, "shape": list(a.shape), "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)  # align the data section to 8 bytes, as the reference writer does
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hb)))
        f.write(hb)
        for raw in blobs:
            f.write(raw)


@dataclasses.dataclass(frozen=True)
class HFCheckpoint:
    config: ModelConfig
    weights: dict[str, np.ndarray]  # float32
    tokenizer_json: Path
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None
    bos_token_id: int | None
    chat_template: str | None
    source_dtype: str  # "BF16" / "F16" / "F32" (of the first tensor imported)
    add_bos_token: bool = False  # tokenizer_config.json's add_bos_token
    note: str = ""  # what the import left out (a Gemma3ForConditionalGeneration's vision parts)


def _read_json(p: Path) -> dict[str, Any]:
    try:
        d = json.loads(p.read_text("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValidationError(f"{p}: cannot read JSON: {e}") from None
    if not isinstance(d, dict):
        raise ValidationError(f"{p}: expected a JSON object")
    return d


def _ids(v: Any) -> tuple[int, ...]:
    if v is None:
        return ()
    if isinstance(v, int):
        return (v,)
    return tuple(int(x) for x in v)


def llama3_rope_divisors(scaling: dict[str, Any], cfg: dict[str, Any], where: Any) -> np.ndarray:
    """Llama 3.1+'s "llama3" RoPE scaling as one divisor per frequency (what llama.cpp's converter
    stores as ``rope_freqs.weight``): 1 for the high frequencies (wavelength below
    ``original_max_position_embeddings / high_freq_factor``), ``factor`` for the low ones (above
    ``... / low_freq_factor``), and between them the inverse of the smooth mix."""
    try:
        factor = float(scaling["factor"])
        low, high = float(scaling.get("low_freq_factor", 1.0)), float(scaling.get("high_freq_factor", 4.0))
        old_ctx = float(scaling.get("original_max_position_embeddings", 8192))
        heads = int(cfg["num_attention_heads"])
        dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
        base = float(cfg.get("rope_theta", 10000.0))
    except (KeyError, TypeError, ValueError) as e:
        raise ValidationError(f"{where}: rope_scaling: {e}") from None
    if not (factor > 0 and high > low > 0 and old_ctx > 0):
        raise ValidationError(f"{where}: rope_scaling: factor, low/high_freq_factor out of range")
    out = []
    for i in range(0, dim, 2):
        wavelen = 2 * math.pi * base ** (i / dim)  # 2 pi / inv_freq
        if wavelen < old_ctx / high:
            out.append(1.0)
        elif wavelen > old_ctx / low:
            out.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


def _scaling_kind(scaling: Any) -> Any:
    """A ``rope_scaling`` / ``rope_parameters`` entry's type ("rope_type", or the older "type")."""
    return scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, dict) else None


def linear_rope_factor(scaling: Mapping[str, Any], key: str, where: Any) -> float:
    """The ``factor`` of a "linear" RoPE scaling entry (``key`` names it in errors): > 0, finite;
    transformers divides the RoPE frequencies by it (``_compute_linear_scaling_rope_parameters``)."""
    raw = scaling.get("factor")
    factor = float(raw) if isinstance(raw, (int, float)) and not isinstance(raw, bool) else math.nan
    if not (math.isfinite(factor) and factor > 0):
        raise ValidationError(f"{where}: {key}.factor {raw!r}: a linear RoPE scaling factor must be"
                              " a number > 0")
    return factor


# transformers' Gemma3TextConfig defaults, for keys a config.json leaves out (a 4B's text_config
# holds little more than its sizes and rope_scaling)
_GEMMA3_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "rms_norm_eps": 1e-6,
    "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
    "sliding_window": 4096, "sliding_window_pattern": 6, "query_pre_attn_scalar": 256,
    "max_position_embeddings": 131072, "tie_word_embeddings": True,
    "hidden_activation": "gelu_pytorch_tanh",
}


# transformers' Gemma2Config defaults (the 2B's sizes), for keys a config.json leaves out
_GEMMA2_DEFAULTS: dict[str, Any] = {
    "vocab_size": 256_000, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "rms_norm_eps": 1e-6,
    "rope_theta": 10_000.0, "sliding_window": 4096, "query_pre_attn_scalar": 256,
    "max_position_embeddings": 8192, "tie_word_embeddings": True,
    "hidden_activation": "gelu_pytorch_tanh",
}
_GEMMA2_SOFTCAPS = (("attn_logit_softcapping", 50.0), ("final_logit_softcapping", 30.0))


def _gemma_activation(cfg_d: Mapping[str, Any], where: Any) -> None:
    act = cfg_d.get("hidden_activation") or cfg_d.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise ValidationError(f"{where}: hidden_activation {act!r} is not supported (gelu_pytorch_tanh)")


def _gemma2_config(cfg_d: Mapping[str, Any], where: Any) -> ModelConfig:
    """A ``Gemma2ForCausalLM`` config.json as a ModelConfig: Gemma 3's without the q/k norms and
    the sliding layers' own RoPE base, with logit soft-capping (a cap given as null: none; absent:
    transformers' default, 50 and 30); every other layer global (``layer_types`` may say so)."""
    c = {**_GEMMA2_DEFAULTS, **{k: v for k, v in cfg_d.items() if v is not None}}
    _gemma_activation(cfg_d, where)
    caps: dict[str, float] = {}
    for k, default in _GEMMA2_SOFTCAPS:
        v = cfg_d[k] if k in cfg_d else default
        try:
            caps[k] = 0.0 if v is None else float(v)
        except (TypeError, ValueError):
            caps[k] = float("nan")
        if not (math.isfinite(caps[k]) and caps[k] >= 0):
            raise ValidationError(f"{where}: {k} {v!r} must be null or a number >= 0")
    theta = c["rope_theta"]
    params = cfg_d.get("rope_parameters")  # newer transformers
    if isinstance(params, dict):
        kinds = [params] if "rope_type" in params or "rope_theta" in params else [
            params.get(k) or {} for k in ("full_attention", "sliding_attention")]
        thetas = {float(p.get("rope_theta", theta)) for p in kinds}
        if any(p.get("rope_type", "default") != "default" for p in kinds) or len(thetas) != 1:
            raise ValidationError(f"{where}: rope_parameters {params!r}: only one default RoPE is"
                                  " supported for Gemma 2")
        theta = thetas.pop()
    layers = int(c["num_hidden_layers"])
    pattern = 2
    if cfg_d.get("layer_types") is not None:
        pattern = _layer_pattern(cfg_d["layer_types"], layers, where)
    window = 0 if pattern == 1 else int(c["sliding_window"])
    try:
        base = ModelConfig.from_hf({**c, "rope_theta": theta})
        return dataclasses.replace(
            base, tie_word_embeddings=bool(c["tie_word_embeddings"]), sliding_window=window,
            sliding_window_pattern=pattern if window else 0,
            query_pre_attn_scalar=float(c["query_pre_attn_scalar"]),
            attn_logit_softcapping=caps["attn_logit_softcapping"],
            final_logit_softcapping=caps["final_logit_softcapping"])
    except (KeyError, ValueError, TypeError) as e:
        raise ValidationError(f"{where}: {e}") from None


def _layer_pattern(types: Any, layers: int, where: Any) -> int:
    """The sliding_window_pattern N that ``layer_types`` spells (layer i full when (i + 1) % N == 0;
    0: every layer slides; 1: none does)."""
    ok = isinstance(types, list) and len(types) == layers and all(
        t in ("sliding_attention", "full_attention") for t in types)
    full = [i for i, t in enumerate(types) if t == "full_attention"] if ok else []
    n = full[0] + 1 if full else 0
    if not ok or [(n == 0 or (i + 1) % n != 0) for i in range(layers)] != \
            [t == "sliding_attention" for t in types]:
        raise ValidationError(f"{where}: layer_types is not 'every Nth layer full attention' (the"
                              " only layout supported)")
    return n


def _gemma3_config(cfg_d: Mapping[str, Any], where: Any) -> ModelConfig:
    """A ``Gemma3ForCausalLM`` config.json as a ModelConfig (module docstring)."""
    c = {**_GEMMA3_DEFAULTS, **{k: v for k, v in cfg_d.items() if v is not None}}
    _gemma_activation(cfg_d, where)
    for k in ("final_logit_softcapping", "attn_logit_softcapping"):
        if cfg_d.get(k) is not None:
            raise ValidationError(f"{where}: {k} {cfg_d[k]!r} is not supported (must be null)")
    factor = 0.0  # linear RoPE scaling of the global layers (the 4B and up: 8)
    scaling = cfg_d.get("rope_scaling")
    if scaling is not None:
        if _scaling_kind(scaling) != "linear":
            raise ValidationError(f"{where}: rope_scaling {_scaling_kind(scaling)!r} is not"
                                  " supported (Gemma 3: only \"linear\")")
        factor = linear_rope_factor(scaling, "rope_scaling", where)
    if cfg_d.get("use_bidirectional_attention"):
        raise ValidationError(f"{where}: use_bidirectional_attention is true; only causal"
                              " attention is supported")
    global_theta, local_theta = c["rope_theta"], c["rope_local_base_freq"]
    params = cfg_d.get("rope_parameters")  # newer transformers: per layer type
    if isinstance(params, dict):
        for kind in ("full_attention", "sliding_attention"):
            p = params.get(kind) or {}
            rt = p.get("rope_type", "default")
            if kind == "full_attention" and rt == "linear":  # the global layers' scaling
                f = linear_rope_factor(p, f"rope_parameters.{kind}", where)
                if scaling is not None and f != factor:
                    raise ValidationError(f"{where}: rope_parameters.{kind}.factor {f} !="
                                          f" rope_scaling.factor {factor}")
                factor = f
            elif rt != "default":
                ok = "'default' or 'linear'" if kind == "full_attention" else "'default'"
                raise ValidationError(f"{where}: rope_parameters.{kind}.rope_type"
                                      f" {p.get('rope_type')!r} is not supported (only {ok})")
        global_theta = (params.get("full_attention") or {}).get("rope_theta", global_theta)
        local_theta = (params.get("sliding_attention") or {}).get("rope_theta", local_theta)
    layers = int(c["num_hidden_layers"])
    pattern = int(c["sliding_window_pattern"])
    if cfg_d.get("layer_types") is not None:
        pattern = _layer_pattern(cfg_d["layer_types"], layers, where)
    window = 0 if pattern == 1 else int(c["sliding_window"])  # pattern 1: every layer global
    try:
        base = ModelConfig.from_hf({**c, "rope_theta": global_theta})
        return dataclasses.replace(
            base, tie_word_embeddings=bool(c["tie_word_embeddings"]), sliding_window=window,
            sliding_window_pattern=pattern if window else 0,
            rope_local_theta=float(local_theta) if window else 0.0,
            query_pre_attn_scalar=float(c["query_pre_attn_scalar"]), rope_scaling_factor=factor)
    except (KeyError, ValueError, TypeError) as e:
        raise ValidationError(f"{where}: {e}") from None


GEMMA3_MM = "Gemma3ForConditionalGeneration"
# its tensors: (prefix, the text model's) in both spellings; the vision parts, left out
_GEMMA3_MM_TEXT = (("model.language_model.", "model."), ("language_model.model.", "model."),
                   ("language_model.lm_head.", "lm_head."), ("lm_head.", "lm_head."))
_GEMMA3_MM_SKIP = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                   "model.multi_modal_projector.")


def _gemma3_text_config(cfg_d: Mapping[str, Any], where: Any) -> dict[str, Any]:
    """A ``Gemma3ForConditionalGeneration`` config.json's ``text_config`` as a ``Gemma3ForCausalLM``
    config.json (module docstring)."""
    text = cfg_d.get("text_config")
    if not isinstance(text, dict):
        raise ValidationError(f"{where}: text_config is {type(text).__name__}; a {GEMMA3_MM} config"
                              " needs its text model's config (an object)")
    top_tie, tie = cfg_d.get("tie_word_embeddings"), text.get("tie_word_embeddings")
    if top_tie is not None and tie is not None and bool(top_tie) != bool(tie):
        raise ValidationError(f"{where}: tie_word_embeddings {top_tie!r} !="
                              f" text_config.tie_word_embeddings {tie!r}")
    out = {**text, "architectures": [GEMMA3]}
    if tie is None and top_tie is not None:
        out["tie_word_embeddings"] = top_tie
    return out


def _gemma3_text_tensor(name: str, where: Any) -> str | None:
    """A ``Gemma3ForConditionalGeneration`` tensor's text-model name (None: a vision part)."""
    for old, new in _GEMMA3_MM_TEXT:
        if name.startswith(old):
            return new + name[len(old):]
    if name.startswith(_GEMMA3_MM_SKIP):
        return None
    raise ValidationError(f"{where}: unexpected tensor {name} for a {GEMMA3_MM} (its text model"
                          " under language_model.model. or model.language_model., vision_tower.,"
                          " multi_modal_projector.)")


def _gemma_norms(weights: dict[str, np.ndarray]) -> None:
    """Gemma's RMSNorm computes x_normed * (1 + weight): store the multiplier, added in float32 as
    transformers adds it (a BF16 package then rounds 1 + weight to BF16 once, where transformers
    keeps the float32 sum)."""
    for k, v in weights.items():
        if k.endswith("norm.weight"):
            weights[k] = (v.astype(np.float32) + np.float32(1.0)).astype(np.float32)


def load_hf_checkpoint(src: str | os.PathLike[str]) -> HFCheckpoint:
    """Read ``config.json``, the safetensors shard(s) (``model.safetensors.index.json`` when
    sharded), ``tokenizer.json`` and, when present, ``generation_config.json`` (EOS/pad/bos ids win)
    and ``tokenizer_config.json`` (chat template; EOS token by name)."""
    d = Path(src)
    top = cfg_d = _read_json(d / "config.json")
    archs = cfg_d.get("architectures") or ["Qwen3ForCausalLM"]
    if archs[0] not in (*ARCHITECTURES, GEMMA3_MM):
        raise ValidationError(
            f"{d / 'config.json'}: architectures {archs} is not one of {[*ARCHITECTURES, GEMMA3_MM]}"
        )
    multimodal = archs[0] == GEMMA3_MM
    if multimodal:  # its text model only (module docstring)
        cfg_d = _gemma3_text_config(top, d / "config.json")
        archs = [GEMMA3]
    for k in ("attention_bias", "mlp_bias"):
        if cfg_d.get(k):
            raise ValidationError(f"{d / 'config.json'}: {k} is true; biases are not supported")
    scaling = cfg_d.get("rope_scaling")
    divisors = None
    linear = 0.0  # linear RoPE scaling: every frequency divided by it
    if scaling and archs[0] != GEMMA3:  # Gemma 3's: its global layers only (_gemma3_config)
        kind = _scaling_kind(scaling)
        if kind == "llama3":
            divisors = llama3_rope_divisors(scaling, cfg_d, d / "config.json")
        elif kind == "linear":
            linear = linear_rope_factor(scaling, "rope_scaling", d / "config.json")
        else:
            raise ValidationError(f"{d / 'config.json'}: rope_scaling {kind!r} is not supported"
                                  " (only Llama 3.1+'s \"llama3\" and \"linear\")")
    if cfg_d.get("use_sliding_window"):  # Qwen2's option (off in the released checkpoints)
        raise ValidationError(f"{d / 'config.json'}: use_sliding_window is true; sliding-window "
                              "attention is not supported")
    try:
        if archs[0] == GEMMA3:
            config = _gemma3_config(cfg_d, f"{d / 'config.json'}{' text_config' if multimodal else ''}")
        elif archs[0] == GEMMA2:
            config = _gemma2_config(cfg_d, d / "config.json")
        else:
            config = ModelConfig.from_hf(cfg_d)
        if divisors is not None:
            config = dataclasses.replace(config, rope_freqs=True)
        if linear:
            config = dataclasses.replace(config, rope_scaling_factor=linear)
    except (KeyError, ValueError, TypeError) as e:
        raise ValidationError(f"{d / 'config.json'}: {e}") from None
    index = d / "model.safetensors.index.json"
    if index.exists():
        wmap = _read_json(index).get("weight_map", {})
        shards = sorted(set(wmap.values()))
    else:
        shards = sorted(p.name for p in d.glob("*.safetensors"))
    if not shards:
        raise ValidationError(f"{d}: no *.safetensors weights")
    weights: dict[str, np.ndarray] = {}
    source_dtype = ""
    skipped = 0  # a Gemma3ForConditionalGeneration's vision tensors
    for s in shards:
        h, _ = read_safetensors_header(d / s)
        names = {k: _gemma3_text_tensor(k, d / s) if multimodal else k for k in h}
        skipped += sum(n is None for n in names.values())
        if config.tie_word_embeddings:  # the head is the embedding: not read
            names = {k: None if n == "lm_head.weight" else n for k, n in names.items()}
        kept = {k for k, n in names.items() if n is not None}
        source_dtype = source_dtype or next((h[k]["dtype"] for k in h if k in kept), "")
        for k, v in load_safetensors(d / s, keep=kept.__contains__).items():
            n = names[k] or k
            if n in weights:
                raise ValidationError(f"{d / s}: tensor {k!r} also in another shard" if n == k else
                                      f"{d / s}: tensor {k!r}: {n} is also spelled another way")
            weights[n] = v
    if config.gemma:
        _gemma_norms(weights)
    if divisors is not None:
        weights[ROPE_FREQS] = divisors
    want = weight_shapes(config)
    extra, missing = sorted(set(weights) - set(want)), sorted(set(want) - set(weights))
    if extra or missing:
        what = f"unexpected tensor {extra[0]}" if extra else f"tensor {missing[0]} missing"
        raise ValidationError(f"{d}: {what} for a {config.architecture}")
    tok = d / "tokenizer.json"
    if not tok.exists():
        raise ValidationError(f"{d}: tokenizer.json missing")
    gen = _read_json(d / "generation_config.json") if (d / "generation_config.json").exists() else {}
    tcfg = _read_json(d / "tokenizer_config.json") if (d / "tokenizer_config.json").exists() else {}
    eos = _ids(gen.get("eos_token_id", top.get("eos_token_id", cfg_d.get("eos_token_id"))))
    if not eos and isinstance(tcfg.get("eos_token"), str):
        import tokenizers

        i = tokenizers.Tokenizer.from_file(str(tok)).token_to_id(tcfg["eos_token"])
        eos = () if i is None else (int(i),)
    pad = gen.get("pad_token_id", top.get("pad_token_id", cfg_d.get("pad_token_id")))
    bos = gen.get("bos_token_id", top.get("bos_token_id", cfg_d.get("bos_token_id")))
    tmpl = tcfg.get("chat_template")
    return HFCheckpoint(
        config=config,
        weights=weights,
        tokenizer_json=tok,
        eos_token_ids=eos,
        pad_token_id=None if pad is None else int(pad),
        bos_token_id=None if bos is None else int(bos),
        chat_template=tmpl if isinstance(tmpl, str) and tmpl else None,
        source_dtype=source_dtype,
        add_bos_token=bool(tcfg.get("add_bos_token", False)),
        note=f"{GEMMA3_MM}: text model only; its vision tower and multi-modal projector ({skipped}"
             " tensors) left out" if multimodal else "",
    )
