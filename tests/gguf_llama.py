"""A Llama (or Qwen2, Phi-3) forward pass in numpy straight from a GGUF file, in llama.cpp's own layout —
the test's independent check of the importer and the kernels.

Shares no code with ``calserve.models.gguf_import`` or ``calserve.runtime.reference``: the tensors
are dequantized here from their raw blocks (Q4_1, Q8_0, F32: what SmolLM2's file holds), the Q/K
rows stay as llama.cpp stores them (a Llama's permuted), and RoPE is llama.cpp's mode for the
architecture: "normal" for ``llama``, which rotates the adjacent pairs (2i, 2i+1) of each head;
"neox" for ``qwen2``, which rotates the pairs (i, i + d/2) and adds the q/k/v biases
(``attn_q.bias`` ...) before it; ``phi3`` is neox too, its q/k/v one fused ``attn_qkv`` matrix and
its gate/up one ``ffn_up`` of twice the rows (the gate first). Only the ``gguf`` package's file
reader is used, for the metadata and the raw bytes. A ``rope_freqs.weight`` tensor (Llama 3.1+)
divides each RoPE frequency, as llama.cpp's ``freq_factors``; linear RoPE scaling multiplies every
angle by ``freq_scale``, read as llama.cpp's load_hparams reads it (``{arch}.rope.scaling.type``,
"linear" when absent, and 1 / ``{arch}.rope.scaling.factor`` or 1 / the older
``{arch}.rope.scale_linear``; type "none": 1). A ``phi3.attention.sliding_window``
W limits every layer's attention to the last W positions (Hugging Face's Phi-3; llama.cpp itself
currently ignores Phi-3's window).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view("<f2").astype(np.float32)


def _dequant(kind: str, raw: np.ndarray, cols: int) -> np.ndarray:
    rows = raw.shape[0]
    if kind == "F32":
        return np.asarray(raw, dtype=np.float32).reshape(rows, cols)
    blocks = raw.reshape(rows, cols // 32, -1)
    if kind == "Q8_0":  # f16 scale d, 32 x int8 q: x = d * q
        d = _f16(blocks[..., 0:2])
        q = blocks[..., 2:34].view(np.int8).astype(np.float32)
        return (d * q).reshape(rows, cols)
    if kind == "Q4_1":  # f16 d, f16 m, 16 bytes: low nibbles are x[0..15], high nibbles x[16..31]
        d, m = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])
        qs = blocks[..., 4:20]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.float32)
        return (d * q + m).reshape(rows, cols)
    raise NotImplementedError(kind)


class GGUFLlama:
    """Weights in GGUF names, float32; ``forward`` keeps a KV cache for one sequence."""

    def __init__(self, path: Path) -> None:
        import gguf  # the file reader only

        r = gguf.GGUFReader(str(path))

        def meta(k: str) -> Any:
            return r.fields[k].contents()

        a = self.arch = str(meta("general.architecture"))
        assert a in ("llama", "qwen2", "phi3"), a
        self.n_layer = int(meta(f"{a}.block_count"))
        self.n_head = int(meta(f"{a}.attention.head_count"))
        self.n_kv = int(meta(f"{a}.attention.head_count_kv"))
        self.d_model = int(meta(f"{a}.embedding_length"))
        self.head_dim = self.d_model // self.n_head
        self.eps = float(meta(f"{a}.attention.layer_norm_rms_epsilon"))
        self.base = float(meta(f"{a}.rope.freq_base"))
        kind = str(meta(f"{a}.rope.scaling.type")) if f"{a}.rope.scaling.type" in r.fields else "linear"
        assert kind in ("none", "linear"), kind
        factor = next((float(meta(k)) for k in (f"{a}.rope.scaling.factor", f"{a}.rope.scale_linear")
                       if k in r.fields), 0.0)
        self.freq_scale = 1.0 if kind == "none" or factor == 0.0 else 1.0 / factor
        key = f"{a}.attention.sliding_window"
        self.window = int(meta(key)) if a == "phi3" and key in r.fields else 0
        self.t: dict[str, np.ndarray] = {}
        for t in r.tensors:
            cols = int(t.shape[0])  # GGUF's first dimension is the row length
            rows = int(np.prod(t.shape[1:])) if len(t.shape) > 1 else 1
            a = _dequant(t.tensor_type.name, np.asarray(t.data).reshape(rows, -1), cols)
            self.t[t.name] = a.reshape(-1) if len(t.shape) == 1 else a
        self.out = self.t.get("output.weight", self.t["token_embd.weight"])
        self.k: list[list[np.ndarray]] = [[] for _ in range(self.n_layer)]
        self.v: list[list[np.ndarray]] = [[] for _ in range(self.n_layer)]

    def _norm(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        return x / np.sqrt(np.mean(x * x) + self.eps) * w

    def _rope(self, x: np.ndarray, pos: int) -> np.ndarray:
        """llama.cpp NORM mode (llama): pairs (2i, 2i+1); NEOX mode (qwen2): pairs (i, i + d/2);
        angle pos * base^(-2i/d) for pair i."""
        d = self.head_dim
        ang = pos * self.base ** (-np.arange(0, d, 2, dtype=np.float64) / d)
        if "rope_freqs.weight" in self.t:  # Llama 3.1+: llama.cpp divides each frequency
            ang = ang / self.t["rope_freqs.weight"].astype(np.float64)
        ang = self.freq_scale * ang  # ggml's rope: theta = freq_scale * theta_extrap
        c, s = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
        first, second = (slice(0, d // 2), slice(d // 2, d)) if self.arch != "llama" else \
            (slice(0, d, 2), slice(1, d, 2))
        a, b = x[:, first], x[:, second]
        out = np.empty_like(x)
        out[:, first] = a * c - b * s
        out[:, second] = a * s + b * c
        return out

    def _proj(self, p: str, name: str, h: np.ndarray) -> np.ndarray:
        y = self.t[p + name + ".weight"] @ h
        bias = self.t.get(p + name + ".bias")  # qwen2's q/k/v
        return y if bias is None else y + bias

    def step(self, token: int) -> np.ndarray:
        """Append ``token``; return the logits of the next token."""
        t, H, KV, D = self.t, self.n_head, self.n_kv, self.head_dim
        pos = len(self.k[0])
        x = t["token_embd.weight"][token].astype(np.float32)
        for i in range(self.n_layer):
            p = f"blk.{i}."
            h = self._norm(x, t[p + "attn_norm.weight"])
            if p + "attn_qkv.weight" in t:  # phi3
                qkv = t[p + "attn_qkv.weight"] @ h
                q_, k_, v_ = qkv[:H * D], qkv[H * D:(H + KV) * D], qkv[(H + KV) * D:]
            else:
                q_, k_, v_ = (self._proj(p, n, h) for n in ("attn_q", "attn_k", "attn_v"))
            q = self._rope(q_.reshape(H, D), pos)
            k = self._rope(k_.reshape(KV, D), pos)
            v = v_.reshape(KV, D)
            self.k[i].append(k)
            self.v[i].append(v)
            first = max(0, pos - self.window + 1) if self.window else 0  # phi3: the last W only
            K, V = np.stack(self.k[i][first:]), np.stack(self.v[i][first:])  # [S, KV, D]
            att = np.empty((H, D), np.float32)
            for hh in range(H):
                kv = hh // (H // KV)
                sc = K[:, kv, :] @ q[hh] / np.sqrt(D)
                w = np.exp(sc - sc.max())
                att[hh] = (w / w.sum()) @ V[:, kv, :]
            x = x + t[p + "attn_output.weight"] @ att.reshape(-1)
            h = self._norm(x, t[p + "ffn_norm.weight"])
            if p + "ffn_gate.weight" in t:
                g, u = t[p + "ffn_gate.weight"] @ h, t[p + "ffn_up.weight"] @ h
            else:  # phi3: [gate; up] in one matrix
                g, u = np.split(t[p + "ffn_up.weight"] @ h, 2)
            x = x + t[p + "ffn_down.weight"] @ (g / (1 + np.exp(-g)) * u)
        return np.asarray(self.out @ self._norm(x, t["output_norm.weight"]), dtype=np.float32)

    def scores(self, prompt: list[int]) -> list[tuple[float, float]]:
        """(logprob of ``prompt[i]``, the highest logprob there) for i >= 1, one forward."""
        for k, v in zip(self.k, self.v):
            k.clear()
            v.clear()
        out = []
        for i in range(len(prompt) - 1):
            z = self.step(prompt[i]).astype(np.float64)
            lse = z.max() + np.log(np.exp(z - z.max()).sum())
            out.append((float(z[prompt[i + 1]] - lse), float(z.max() - lse)))
        return out

    def greedy(self, prompt: list[int], n: int) -> tuple[list[int], list[float], list[float]]:
        """(tokens, their logprobs, the top-2 logit gap at each step) of ``n`` greedy steps."""
        for k, v in zip(self.k, self.v):
            k.clear()
            v.clear()
        for tok in prompt[:-1]:
            self.step(tok)
        logits = self.step(prompt[-1])
        toks, lps, gaps = [], [], []
        for _ in range(n):
            z = logits.astype(np.float64)
            lse = z.max() + np.log(np.exp(z - z.max()).sum())
            top2 = np.sort(z)[-2:]
            tok = int(np.argmax(z))
            toks.append(tok)
            lps.append(float(z[tok] - lse))
            gaps.append(float(top2[1] - top2[0]))
            logits = self.step(tok)
        return toks, lps, gaps
