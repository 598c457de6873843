"""Numpy reference of the decoders (Qwen3, Llama, Qwen2, Gemma 3, Gemma 2) that the software CalRT computes.

This is the definition of "correct" for every other implementation in the tree: the C kernels of
calrt-sim are checked against it (tests/runtime), golden files of model packages are produced with it
(calserve/models), and a future ``calserve device-check`` compares a board with it.

Architecture (Hugging Face ``Qwen3ForCausalLM``; ``LlamaForCausalLM`` is the same decoder without the
per-head q/k RMSNorm — ``ModelConfig.qk_norm`` — with its own RoPE base and a tied or untied head;
``Qwen2ForCausalLM`` is Llama with a bias on the q, k and v projections — ``ModelConfig.qkv_bias``):

    x = embed[token]
    for each layer:
        h = rmsnorm(x, input_layernorm)
        q = h @ Wq.T (+ bq)  -> [n_heads, head_dim];   q = rmsnorm(q, q_norm) per head;  q = rope(q, pos)
        k = h @ Wk.T (+ bk)  -> [n_kv, head_dim];      k = rmsnorm(k, k_norm) per head;  k = rope(k, pos)
        v = h @ Wv.T (+ bv)  -> [n_kv, head_dim]
        (K, V appended to the cache; bf16 caches round K and V to bf16, round-to-nearest-even)
        a = softmax(q . K^T / sqrt(head_dim), causal) . V   (GQA: head i reads kv head i // (n_heads/n_kv))
        x = x + a @ Wo.T
        h = rmsnorm(x, post_attention_layernorm)
        x = x + (silu(h @ Wg.T) * (h @ Wu.T)) @ Wd.T
    logits = rmsnorm(x, norm) @ lm_head.T      (lm_head = embed when tie_word_embeddings)

RoPE uses the "neox" layout (rotate_half over the two halves of head_dim), which is Hugging Face's for
every family; with ``ModelConfig.rope_freqs`` (Llama 3.1+'s "llama3" scaling) frequency i is divided by
``model.rope_freqs.weight[i]`` (a GGUF Llama's Q/K rows are un-permuted into it on import). All math is float32.
Weight names and shapes are Hugging Face's; see :func:`weight_shapes`.

Any family may have sliding-window layers (``ModelConfig.sliding_window`` and its pattern: such a
layer's position p attends to [p - window + 1, p] only; Phi-3's every layer, Gemma 3's five of six).
``Gemma3ForCausalLM`` (``ModelConfig.gemma``) is Qwen3's decoder with: the embedding times
sqrt(hidden_size); the attention's output RMS-normed (``post_attention_layernorm``) before its
residual add, the MLP's input normed by ``pre_feedforward_layernorm`` and its output by
``post_feedforward_layernorm`` before its add; GELU (tanh approximation) instead of SiLU; scores
divided by sqrt(query_pre_attn_scalar); the sliding layers' own RoPE base (``rope_local_theta``).
Linear RoPE scaling (``rope_scaling_factor``: Gemma 3 4B and up, on their global layers) divides
the frequencies of every layer but the sliding ones with their own base.
Its norm weights are stored as the multiplier (Gemma's ``1 + weight``: importers add the 1).
``Gemma2ForCausalLM`` is Gemma 3's decoder without the per-head q/k RMSNorm (as Llama is Qwen3's),
with one RoPE base and every other layer sliding (pattern 2: layer 0 slides).

Logit soft-capping (any family; Gemma 2's): with ``attn_logit_softcapping`` c > 0 each attention
score s (after the division by the score scale) becomes c * tanh(s / c) before the mask and the
softmax; with ``final_logit_softcapping`` c > 0 each output logit x (after the lm_head product)
becomes c * tanh(x / c). See :func:`_softcap`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

__all__ = [
    "ARCHITECTURES",
    "ModelConfig",
    "weight_shapes",
    "random_weights",
    "bf16_round",
    "ReferenceModel",
    "greedy_generate",
]


QWEN3 = "Qwen3ForCausalLM"
LLAMA = "LlamaForCausalLM"
QWEN2 = "Qwen2ForCausalLM"
GEMMA3 = "Gemma3ForCausalLM"
GEMMA2 = "Gemma2ForCausalLM"
ROPE_FREQS = "model.rope_freqs.weight"  # calrt.h's CALRT_ROPE_FREQS_TENSOR
ARCHITECTURES: tuple[str, ...] = (QWEN3, LLAMA, QWEN2, GEMMA3, GEMMA2)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The architecture figures of a Qwen3, Llama, Qwen2, Gemma 3 or Gemma 2 decoder (names follow HF
    ``config.json``)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 40960
    architecture: str = QWEN3
    # Llama 3.1+: RoPE frequency i divided by the tensor ``model.rope_freqs.weight`` [head_dim / 2]
    rope_freqs: bool = False
    # Sliding-window attention (any family): a sliding layer's position p attends to positions
    # [p - sliding_window + 1, p] only (0: no layer slides). sliding_window_pattern N > 0: layer i
    # (from 0) attends globally when (i + 1) % N == 0 and slides otherwise (Gemma 3: 6); 0: every
    # layer slides.
    sliding_window: int = 0
    sliding_window_pattern: int = 0
    # RoPE base of the sliding layers (Gemma 3: 10,000 where the global layers have 1,000,000);
    # 0: rope_theta
    rope_local_theta: float = 0.0
    # attention scores are divided by sqrt(query_pre_attn_scalar) (Gemma); 0: by sqrt(head_dim)
    query_pre_attn_scalar: float = 0.0
    # Linear RoPE scaling: every layer's RoPE frequencies divided by it (positions divided by it),
    # except the sliding layers that have their own base (rope_local_theta > 0: Gemma 3's local
    # layers keep theirs unscaled, as llama.cpp and Hugging Face compute them); 0 or 1: none
    rope_scaling_factor: float = 0.0
    # Logit soft-capping (Gemma 2: 50 and 30): c > 0: each attention score s (after the division
    # above) becomes c * tanh(s / c) before the mask and the softmax / each output logit x becomes
    # c * tanh(x / c); 0: none
    attn_logit_softcapping: float = 0.0
    final_logit_softcapping: float = 0.0

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"ModelConfig.architecture must be one of {list(ARCHITECTURES)}")
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
        ):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"ModelConfig.{name} must be >= 1")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.head_dim % 2:
            raise ValueError("head_dim must be even (RoPE rotates pairs)")
        if self.sliding_window < 0 or self.sliding_window_pattern < 0:
            raise ValueError("sliding_window and sliding_window_pattern must be >= 0")
        if self.rope_local_theta < 0 or self.query_pre_attn_scalar < 0 or self.rope_scaling_factor < 0:
            raise ValueError("rope_local_theta, query_pre_attn_scalar and rope_scaling_factor must be >= 0")
        for name in ("attn_logit_softcapping", "final_logit_softcapping"):
            cap = float(getattr(self, name))
            if not (cap >= 0 and math.isfinite(cap)):
                raise ValueError(f"ModelConfig.{name} must be finite and >= 0 (0: none)")

    def sliding(self, layer: int) -> bool:
        """Whether ``layer`` attends to a sliding window (the fields' comment)."""
        if self.sliding_window <= 0:
            return False
        n = self.sliding_window_pattern
        return n == 0 or (layer + 1) % n != 0

    def layer_rope_theta(self, layer: int) -> float:
        """``layer``'s RoPE base."""
        if self.rope_local_theta > 0 and self.sliding(layer):
            return self.rope_local_theta
        return self.rope_theta

    def layer_rope_factor(self, layer: int) -> float:
        """What ``layer``'s RoPE frequencies are divided by (linear scaling; 1: none)."""
        f = self.rope_scaling_factor
        if f <= 0 or (self.rope_local_theta > 0 and self.sliding(layer)):
            return 1.0
        return f

    @property
    def attn_scale(self) -> float:
        """What attention divides q . k by."""
        return float(np.sqrt(np.float32(self.query_pre_attn_scalar or self.head_dim)))

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any]) -> ModelConfig:
        """Build from a Hugging Face ``config.json`` dict (extra keys ignored: the sliding window,
        Gemma's local RoPE base and score scale are read by ``calserve.models.hf``, which checks
        their spellings; so are Gemma 2's logit soft-caps, which other families' configs ignore)."""
        heads = int(cfg["num_attention_heads"])
        archs = cfg.get("architectures") or [QWEN3]
        return cls(
            architecture=str(archs[0]),
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads", heads)),
            head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(cfg.get("rope_theta", 1_000_000.0)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 40960)),
        )

    @property
    def qk_norm(self) -> bool:
        """Qwen3 and Gemma 3 RMS-normalise each head of q and k before RoPE; Llama, Qwen2 and Gemma 2
        do not."""
        return self.architecture in (QWEN3, GEMMA3)

    @property
    def gemma(self) -> bool:
        """Gemma 3 and 2: embeddings times sqrt(hidden_size), the attention's and the MLP's outputs
        RMS-normed before their residual adds, GELU (tanh) in the MLP."""
        return self.architecture in (GEMMA3, GEMMA2)

    @property
    def qkv_bias(self) -> bool:
        """Qwen2 adds a bias to the q, k and v projections; Qwen3 and Llama do not."""
        return self.architecture == QWEN2

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def kv_bytes_per_token_fp32(self) -> int:
        """K and V of every layer for one token, stored as float32."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * 4

    def parameter_count(self) -> int:
        return sum(int(np.prod(s)) for s in weight_shapes(self).values())


def weight_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a Qwen3/Llama/Qwen2/Gemma 3/Gemma 2 checkpoint must have, HF names -> shape
    (out_features first)."""
    h, d = cfg.hidden_size, cfg.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (cfg.num_attention_heads * d, h)
        shapes[p + "self_attn.k_proj.weight"] = (cfg.num_key_value_heads * d, h)
        shapes[p + "self_attn.v_proj.weight"] = (cfg.num_key_value_heads * d, h)
        if cfg.qkv_bias:
            shapes[p + "self_attn.q_proj.bias"] = (cfg.num_attention_heads * d,)
            shapes[p + "self_attn.k_proj.bias"] = (cfg.num_key_value_heads * d,)
            shapes[p + "self_attn.v_proj.bias"] = (cfg.num_key_value_heads * d,)
        shapes[p + "self_attn.o_proj.weight"] = (h, cfg.num_attention_heads * d)
        if cfg.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (d,)
            shapes[p + "self_attn.k_norm.weight"] = (d,)
        # (Gemma 3, 2: the attention output's norm; every other family: the MLP input's)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        if cfg.gemma:  # the MLP's input and output norms
            shapes[p + "pre_feedforward_layernorm.weight"] = (h,)
            shapes[p + "post_feedforward_layernorm.weight"] = (h,)
        shapes[p + "mlp.gate_proj.weight"] = (cfg.intermediate_size, h)
        shapes[p + "mlp.up_proj.weight"] = (cfg.intermediate_size, h)
        shapes[p + "mlp.down_proj.weight"] = (h, cfg.intermediate_size)
    shapes["model.norm.weight"] = (h,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    if cfg.rope_freqs:
        shapes[ROPE_FREQS] = (d // 2,)
    return shapes


def random_weights(cfg: ModelConfig, seed: int = 0, scale: float = 0.08) -> dict[str, np.ndarray]:
    """Seeded random float32 weights with sane magnitudes (norm weights near 1)."""
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    for name, shape in weight_shapes(cfg).items():
        if name.endswith("norm.weight"):
            w = 1.0 + 0.1 * rng.standard_normal(shape)
        elif name.endswith(".bias"):  # Qwen2's q/k/v biases: large enough to matter
            w = 0.5 * rng.standard_normal(shape)
        elif name == ROPE_FREQS:  # divisors from 1 (high frequencies) to 32, as Llama 3.1's
            w = np.geomspace(1.0, 32.0, shape[0]) * (1 + 0.1 * rng.random(shape))
        else:
            fan_in = shape[-1]
            w = rng.standard_normal(shape) * (scale if len(shape) == 1 else 1.0 / np.sqrt(fan_in))
        out[name] = np.ascontiguousarray(w, dtype=np.float32)
    return out


def bf16_round(x: np.ndarray) -> np.ndarray:
    """Round float32 to the nearest bfloat16 (ties to even) and back to float32."""
    a = np.ascontiguousarray(x, dtype=np.float32)
    u = a.view(np.uint32).astype(np.uint64)
    rounding = ((u >> 16) & 1) + 0x7FFF
    r = ((u + rounding) >> 16) << 16
    # NaN stays NaN (keep a mantissa bit), inf stays inf.
    nan = np.isnan(a)
    out = (r & 0xFFFFFFFF).astype(np.uint32).view(np.float32)
    if nan.any():
        out = out.copy()
        out[nan] = np.nan
    return out


def _rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    ms = np.mean(x.astype(np.float32) ** 2, axis=-1, keepdims=True)
    out: np.ndarray = (x / np.sqrt(ms + np.float32(eps))).astype(np.float32) * w
    return out


def _rope(x: np.ndarray, positions: np.ndarray, theta: float,
          divisors: np.ndarray | None = None, factor: float = 1.0) -> np.ndarray:
    """x: [T, heads, d]; positions: [T]. Neox layout; ``divisors`` of each frequency (or None),
    then every frequency divided by ``factor`` (linear scaling)."""
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    if divisors is not None:
        inv_freq = inv_freq / divisors.astype(np.float64)
    if factor != 1.0:
        inv_freq = inv_freq / float(factor)
    freqs = positions.astype(np.float64)[:, None] * inv_freq[None, :]  # [T, d/2]
    cos = np.cos(freqs).astype(np.float32)[:, None, :]
    sin = np.sin(freqs).astype(np.float32)[:, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(np.float32)


def _silu(x: np.ndarray) -> np.ndarray:
    out: np.ndarray = (x / (1.0 + np.exp(-x))).astype(np.float32)
    return out


def _gelu_tanh(x: np.ndarray) -> np.ndarray:
    """GELU, tanh approximation (Gemma's ``gelu_pytorch_tanh``)."""
    x64 = x.astype(np.float64)
    out: np.ndarray = (0.5 * x64 * (1.0 + np.tanh(np.sqrt(2.0 / np.pi)
                                                  * (x64 + 0.044715 * x64 ** 3)))).astype(np.float32)
    return out


def _softcap(x: np.ndarray, cap: float) -> np.ndarray:
    """Logit soft-capping: cap * tanh(x / cap) elementwise (Gemma 2's attention scores and final
    logits), float32 like HF's; tanh evaluated in float64 and rounded once (calrt-sim's libm tanhf
    agrees to within an ulp)."""
    c = np.float32(cap)
    t = np.tanh((np.asarray(x, dtype=np.float32) / c).astype(np.float64)).astype(np.float32)
    out: np.ndarray = (c * t).astype(np.float32)
    return out


class ReferenceModel:
    """A Qwen3/Llama/Qwen2/Gemma 3/Gemma 2 forward pass with a KV cache for one sequence.

    ``kv_dtype="bf16"`` rounds cached K and V to bfloat16 exactly as a bf16 KV cache would.
    """

    def __init__(
        self, cfg: ModelConfig, weights: Mapping[str, np.ndarray], kv_dtype: str = "fp32"
    ) -> None:
        if kv_dtype not in ("fp32", "bf16"):
            raise ValueError(f"kv_dtype must be 'fp32' or 'bf16', not {kv_dtype!r}")
        self.cfg = cfg
        self.w = {k: np.asarray(v, dtype=np.float32) for k, v in weights.items()}
        self.kv_dtype = kv_dtype
        L = cfg.num_hidden_layers
        self.k_cache: list[np.ndarray] = [
            np.zeros((0, cfg.num_key_value_heads, cfg.head_dim), np.float32) for _ in range(L)
        ]
        self.v_cache: list[np.ndarray] = [
            np.zeros((0, cfg.num_key_value_heads, cfg.head_dim), np.float32) for _ in range(L)
        ]

    @property
    def length(self) -> int:
        return int(self.k_cache[0].shape[0])

    def truncate(self, length: int) -> None:
        """Drop cached tokens past ``length`` (RemoveTokensAtEnd)."""
        self.k_cache = [k[:length] for k in self.k_cache]
        self.v_cache = [v[:length] for v in self.v_cache]

    def forward(self, tokens: np.ndarray | list[int]) -> np.ndarray:
        """Append ``tokens`` at the current length; return logits [T, vocab] for every new position."""
        cfg, w = self.cfg, self.w
        toks = np.asarray(tokens, dtype=np.int64).reshape(-1)
        T = toks.shape[0]
        start = self.length
        pos = np.arange(start, start + T)
        H, KV, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        group = H // KV
        x = w["model.embed_tokens.weight"][toks]  # [T, h]
        if cfg.gemma:
            x = x * np.float32(np.sqrt(np.float32(cfg.hidden_size)))
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            h = _rmsnorm(x, w[p + "input_layernorm.weight"], cfg.rms_norm_eps)
            q = h @ w[p + "self_attn.q_proj.weight"].T
            k = h @ w[p + "self_attn.k_proj.weight"].T
            v = h @ w[p + "self_attn.v_proj.weight"].T
            if cfg.qkv_bias:
                q = q + w[p + "self_attn.q_proj.bias"]
                k = k + w[p + "self_attn.k_proj.bias"]
                v = v + w[p + "self_attn.v_proj.bias"]
            q, k, v = q.reshape(T, H, D), k.reshape(T, KV, D), v.reshape(T, KV, D)
            if cfg.qk_norm:
                q = _rmsnorm(q, w[p + "self_attn.q_norm.weight"], cfg.rms_norm_eps)
                k = _rmsnorm(k, w[p + "self_attn.k_norm.weight"], cfg.rms_norm_eps)
            theta, factor = cfg.layer_rope_theta(i), cfg.layer_rope_factor(i)
            q = _rope(q, pos, theta, w.get(ROPE_FREQS), factor)
            k = _rope(k, pos, theta, w.get(ROPE_FREQS), factor)
            if self.kv_dtype == "bf16":
                k, v = bf16_round(k), bf16_round(v)
            self.k_cache[i] = np.concatenate([self.k_cache[i], k.astype(np.float32)])
            self.v_cache[i] = np.concatenate([self.v_cache[i], v.astype(np.float32)])
            K, V = self.k_cache[i], self.v_cache[i]  # [S, KV, D]
            S = K.shape[0]
            kh = np.repeat(K, group, axis=1).transpose(1, 0, 2)  # [H, S, D]
            vh = np.repeat(V, group, axis=1).transpose(1, 0, 2)
            scores = np.einsum("thd,hsd->hts", q, kh) / np.float32(cfg.attn_scale)
            if cfg.attn_logit_softcapping > 0:  # Gemma 2: soft-capped, before the mask
                scores = _softcap(scores, cfg.attn_logit_softcapping)
            masked = np.arange(S)[None, :] > pos[:, None]  # [T, S]: causal
            if cfg.sliding(i):  # and a sliding layer's window
                masked |= np.arange(S)[None, :] <= pos[:, None] - cfg.sliding_window
            scores = np.where(masked[None], -np.inf, scores)
            scores = scores - scores.max(axis=-1, keepdims=True)
            pr = np.exp(scores)
            pr = pr / pr.sum(axis=-1, keepdims=True)
            a = np.einsum("hts,hsd->thd", pr.astype(np.float32), vh).reshape(T, H * D)
            o = a @ w[p + "self_attn.o_proj.weight"].T
            if cfg.gemma:  # Gemma's sandwich: the outputs normed before their residual adds
                o = _rmsnorm(o, w[p + "post_attention_layernorm.weight"], cfg.rms_norm_eps)
                x = x + o
                h = _rmsnorm(x, w[p + "pre_feedforward_layernorm.weight"], cfg.rms_norm_eps)
                g = _gelu_tanh(h @ w[p + "mlp.gate_proj.weight"].T) * (h @ w[p + "mlp.up_proj.weight"].T)
                f = _rmsnorm(g @ w[p + "mlp.down_proj.weight"].T,
                             w[p + "post_feedforward_layernorm.weight"], cfg.rms_norm_eps)
                x = (x + f).astype(np.float32)
                continue
            x = x + o
            h = _rmsnorm(x, w[p + "post_attention_layernorm.weight"], cfg.rms_norm_eps)
            g = _silu(h @ w[p + "mlp.gate_proj.weight"].T) * (h @ w[p + "mlp.up_proj.weight"].T)
            x = (x + g @ w[p + "mlp.down_proj.weight"].T).astype(np.float32)
        x = _rmsnorm(x, w["model.norm.weight"], cfg.rms_norm_eps)
        head = w["model.embed_tokens.weight"] if cfg.tie_word_embeddings else w["lm_head.weight"]
        logits = (x @ head.T).astype(np.float32)
        if cfg.final_logit_softcapping > 0:  # Gemma 2: soft-capped logits
            logits = _softcap(logits, cfg.final_logit_softcapping)
        return logits


def greedy_generate(
    cfg: ModelConfig,
    weights: Mapping[str, np.ndarray],
    prompt: list[int],
    steps: int,
    kv_dtype: str = "fp32",
) -> list[int]:
    """Prefill ``prompt`` then decode ``steps`` greedy tokens (argmax, lowest id on ties)."""
    m = ReferenceModel(cfg, weights, kv_dtype)
    logits = m.forward(prompt)[-1]
    out: list[int] = []
    for _ in range(steps):
        t = int(np.argmax(logits))
        out.append(t)
        logits = m.forward([t])[-1]
    return out
