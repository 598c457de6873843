"""GGUF files for the ``peer`` scenario: the same weights calserve serves, in llama.cpp's format.

- :func:`export_package`: a calserve package (``Qwen3ForCausalLM`` or ``LlamaForCausalLM`` with a
  byte-level BPE ``tokenizer.json``, e.g. the built-in demo model) as an F32 GGUF that llama.cpp loads:
  Hugging Face tensor names to GGUF's (the inverse of ``calserve.models.gguf_import``), a Llama's Q/K
  rows permuted for llama.cpp's interleaved RoPE (Qwen3 uses rotate-half there too: unpermuted), the
  tokenizer as ``tokenizer.ggml.*`` (tokens, merges, token types, ``pre = gpt-2``: the regex of HF's
  ``ByteLevel`` pre-tokenizer), EOS/PAD and ``add_bos_token`` from the manifest.
- :func:`gguf_to_f32`: a (quantized) GGUF rewritten with every tensor dequantized to F32 and all its
  metadata kept (``general.file_type`` = ALL_F32): SmolLM2's Q4_1 file as the F32 values calserve's
  ``pack --from-gguf`` stores.

``python -m bench.peer_gguf demo OUT.gguf`` / ``python -m bench.peer_gguf f32 SRC.gguf OUT.gguf``.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["export_package", "gguf_to_f32", "gguf_tensor_name", "llamacpp_permute"]

_LAYER = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_ARCH = {"Qwen3ForCausalLM": "qwen3", "LlamaForCausalLM": "llama"}
_CONTROL, _NORMAL = 3, 1  # llama.cpp token types


def gguf_tensor_name(hf: str) -> str:
    """``model.layers.3.self_attn.q_proj.weight`` -> ``blk.3.attn_q.weight``."""
    if hf in _GLOBAL:
        return _GLOBAL[hf]
    parts = hf.split(".")
    if len(parts) >= 5 and parts[:2] == ["model", "layers"] and parts[-1] == "weight":
        sub = ".".join(parts[3:-1])
        if sub in _LAYER:
            return f"blk.{parts[2]}.{_LAYER[sub]}.weight"
    raise ValueError(f"tensor {hf} has no GGUF name in a llama/qwen3 decoder")


def llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter ``permute`` of a Llama Q/K projection: in each head, checkpoint row
    ``j * d/2 + i`` becomes row ``2i + j`` (the inverse of ``gguf_import.unpermute_rope_rows``)."""
    d = w.shape[0] // n_head
    out = w.reshape(n_head, 2, d // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    return np.ascontiguousarray(out)


def _tokenizer_fields(tok_json: str) -> tuple[list[str], list[int], list[str]]:
    tj = json.loads(tok_json)
    model = tj.get("model") or {}
    if model.get("type") != "BPE":
        raise ValueError(f"tokenizer.json model type {model.get('type')!r}: only BPE exports")
    pre = tj.get("pre_tokenizer") or {}
    if pre.get("type") != "ByteLevel" or pre.get("add_prefix_space") or not pre.get("use_regex", True):
        raise ValueError("tokenizer.json: only a plain ByteLevel pre-tokenizer (GPT-2 regex) exports")
    vocab: dict[str, int] = dict(model["vocab"])
    for t in tj.get("added_tokens") or []:
        vocab.setdefault(t["content"], int(t["id"]))
    special = {int(t["id"]) for t in tj.get("added_tokens") or [] if t.get("special")}
    n = max(vocab.values()) + 1
    tokens = [""] * n
    for s, i in vocab.items():
        tokens[i] = s
    if any(t == "" for t in tokens):
        raise ValueError("tokenizer.json: token ids are not contiguous")
    types = [_CONTROL if i in special else _NORMAL for i in range(n)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    return tokens, types, merges


def export_package(pkg: str | os.PathLike[str], out: str | os.PathLike[str]) -> Path:
    """Write the calserve package directory ``pkg`` as the F32 GGUF ``out`` (see the module doc).

    Reads the package's files directly (the scenario built or verified it before serving it)."""
    import gguf

    from calserve.models.hf import load_safetensors
    from calserve.models.manifest import decode_manifest

    p = Path(pkg)
    man = decode_manifest((p / "manifest.json").read_bytes(), str(p / "manifest.json"))
    cfg = man.model_config()
    arch = _ARCH.get(cfg.architecture)
    if arch is None:
        raise ValueError(f"{p}: architecture {cfg.architecture} does not export")
    weights: dict[str, np.ndarray] = {}
    for f in man.weights:
        weights.update(load_safetensors(p / f))
    tokens, types, merges = _tokenizer_fields((p / man.tokenizer).read_text())
    if len(tokens) != cfg.vocab_size:
        raise ValueError(f"{p}: {len(tokens)} tokens but vocab_size {cfg.vocab_size}")
    wr = _open_writer(out, arch)
    wr.add_name(man.name)
    wr.add_file_type(int(gguf.LlamaFileType.ALL_F32))
    wr.add_context_length(int(cfg.max_position_embeddings))
    wr.add_embedding_length(cfg.hidden_size)
    wr.add_block_count(cfg.num_hidden_layers)
    wr.add_feed_forward_length(cfg.intermediate_size)
    wr.add_head_count(cfg.num_attention_heads)
    wr.add_head_count_kv(cfg.num_key_value_heads)
    wr.add_key_length(cfg.head_dim)
    wr.add_value_length(cfg.head_dim)
    wr.add_rope_dimension_count(cfg.head_dim)
    wr.add_layer_norm_rms_eps(float(cfg.rms_norm_eps))
    wr.add_rope_freq_base(float(cfg.rope_theta))
    wr.add_vocab_size(cfg.vocab_size)
    wr.add_tokenizer_model("gpt2")
    wr.add_tokenizer_pre("gpt-2")
    wr.add_token_list(tokens)
    wr.add_token_types(types)
    wr.add_token_merges(merges)
    st = man.special_tokens
    if st.eos_token_ids:
        wr.add_eos_token_id(int(st.eos_token_ids[0]))
    if st.pad_token_id is not None:
        wr.add_pad_token_id(int(st.pad_token_id))
    if st.bos_token_id is not None:
        wr.add_bos_token_id(int(st.bos_token_id))
    wr.add_add_bos_token(bool(st.add_bos_token))
    if man.chat_template:
        wr.add_chat_template(man.chat_template)
    for name in sorted(weights):
        if cfg.tie_word_embeddings and name == "lm_head.weight":
            continue
        w = np.asarray(weights[name], np.float32)
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            w = llamacpp_permute(w, cfg.num_attention_heads if "q_proj" in name
                                 else cfg.num_key_value_heads)
        wr.add_tensor(gguf_tensor_name(name), np.ascontiguousarray(w))
    return _finish(wr, out)


def gguf_to_f32(src: str | os.PathLike[str], out: str | os.PathLike[str]) -> Path:
    """Rewrite the GGUF ``src`` with every tensor dequantized to F32 (metadata kept)."""
    import gguf
    from gguf import quants

    reader = gguf.GGUFReader(str(src))
    arch_field = reader.get_field("general.architecture")
    if arch_field is None:
        raise ValueError(f"{src}: no general.architecture")
    wr = _open_writer(out, str(arch_field.contents()))
    for field in reader.fields.values():
        if field.name in ("general.architecture", "general.file_type") or field.name.startswith("GGUF."):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        val: Any = field.contents()
        if val is not None:
            wr.add_key_value(field.name, val, vtype, sub_type=sub)
    wr.add_file_type(int(gguf.LlamaFileType.ALL_F32))
    for t in reader.tensors:
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))  # GGUF lists the fastest axis first
        if t.tensor_type == gguf.GGMLQuantizationType.F32:
            a = np.asarray(t.data, np.float32)
        else:
            a = quants.dequantize(np.asarray(t.data), t.tensor_type).astype(np.float32, copy=False)
        wr.add_tensor(t.name, np.ascontiguousarray(a.reshape(shape)))
    return _finish(wr, out)



def _part(out: str | os.PathLike[str]) -> Path:
    """Where a GGUF bound for ``out`` is written first (renamed into place once complete)."""
    out_p = Path(out)
    return out_p.with_name(out_p.name + ".part")


def _open_writer(out: str | os.PathLike[str], arch: str) -> Any:
    """A GGUFWriter for ``out``'s ``.part`` file (its directory created)."""
    import gguf

    Path(out).parent.mkdir(parents=True, exist_ok=True)
    return gguf.GGUFWriter(str(_part(out)), arch)


def _finish(wr: Any, out: str | os.PathLike[str]) -> Path:
    """Write ``wr``'s header, metadata and tensors, close it and rename it onto ``out``: a reader
    never sees a half-written file."""
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    os.replace(_part(out), out)
    return Path(out)

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.peer_gguf", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="the built-in demo package (or --package DIR) as F32 GGUF")
    d.add_argument("out", type=Path)
    d.add_argument("--package", type=Path, help="a calserve package dir (default: the demo)")
    f = sub.add_parser("f32", help="a GGUF with every tensor dequantized to F32")
    f.add_argument("src")
    f.add_argument("out", type=Path)
    a = ap.parse_args(argv)
    if a.cmd == "demo":
        pkg = a.package
        if pkg is None:
            from calserve.models.demo import ensure_demo_package
            pkg = ensure_demo_package()
        print(export_package(pkg, a.out))
    else:
        from calserve.models.gguf_import import resolve_gguf_path
        print(gguf_to_f32(resolve_gguf_path(a.src), a.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
