"""Building signed packages: from a HF Qwen3/Llama/Qwen2/Gemma 3 checkpoint, or the built-in demo model
(GGUF files: :mod:`calserve.models.gguf_import`).

A package is assembled in a temp dir next to ``out`` and atomically renamed into place, so a reader
never sees a half-written package. Golden outputs are computed with the numpy reference
(``greedy_generate``) per profile, with that profile's KV dtype, on the weights *as stored* (BF16 ->
float32), which is exactly what the runtime loads.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

import msgspec
import numpy as np

from calserve.errors import ConfigError, PackageError
from calserve.models import demo_model
from calserve.models.capacity import pool_bytes
from calserve.models.hf import load_hf_checkpoint, load_safetensors, write_safetensors
from calserve.models.manifest import (
    FORMAT,
    CapacityManifest,
    Golden,
    GoldenCase,
    InactivePolicy,
    KvLayout,
    Manifest,
    ProfileManifest,
    SpecialTokens,
    TimingManifest,
    architecture_from_config,
    encode_manifest,
    parameter_bytes,
)
from calserve.models.signing import sign_package
from calserve.models.timing import timing_profile
from calserve.models.tokenizer import CHATML, Tokenizer
from calserve.runtime.reference import ModelConfig, ReferenceModel

__all__ = [
    "pack_from_hf",
    "pack_demo",
    "build_package",
    "make_profiles",
    "pool_bytes",
    "DEFAULT_PROFILES",
    "GOLDEN_PROMPTS",
    "GOLDEN_STEPS",
]

log = logging.getLogger(__name__)

DEFAULT_PROFILES: tuple[int, ...] = (1, 4, 8, 16)
WEIGHTS_FILE = "model.safetensors"
GOLDEN_PROMPTS: tuple[str, ...] = (
    "The Calculet NPU",
    "<|im_start|>user\nHello, who are you?<|im_end|>\n<|im_start|>assistant\n",
    "1, 2, 3, 4,",
)
GOLDEN_STEPS = 12
_KV_BYTES = {"fp32": 4, "bf16": 2}


def kv_bytes_per_token(cfg: ModelConfig, kv_dtype: str) -> int:
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * _KV_BYTES[kv_dtype]


def make_profiles(
    cfg: ModelConfig,
    batches: Sequence[int],
    *,
    max_seq: int,
    max_sequences: int | None,
    kv_dtype: str,
) -> list[ProfileManifest]:
    """The profiles the software "compiler" emits: valid-mask contract, inactive lanes write no KV
    and return zero logits (spec §7.3); tier C0 for B1, C3 for B>1 (spec §1)."""
    out = []
    for b in sorted(set(batches)):
        out.append(
            ProfileManifest(
                compiled_batch=b,
                max_seq=max_seq,
                max_sequences=max_sequences if max_sequences is not None else max(16, 4 * b),
                kv_dtype=kv_dtype,  # type: ignore[arg-type]
                inactive_policy=InactivePolicy(valid_mask=True, logits_returned=True, writes_kv=False),
                kv_layout=KvLayout(
                    layers=cfg.num_hidden_layers,
                    kv_heads=cfg.num_key_value_heads,
                    head_dim=cfg.head_dim,
                    dtype=kv_dtype,  # type: ignore[arg-type]
                    bytes_per_token=kv_bytes_per_token(cfg, kv_dtype),
                ),
                tier="C0" if b == 1 else "C3",
            )
        )
    return out


def _greedy_with_margin(
    cfg: ModelConfig, weights: Mapping[str, np.ndarray], prompt: list[int], steps: int, kv_dtype: str
) -> list[int]:
    """Greedy tokens, cut before the first step whose top-2 logit gap is a near-tie.

    A kernel that sums in another order may legitimately pick the other token of a near-tie, so the
    golden file only pins tokens whose argmax is robust (gap > 1e-3 x max|logit|).
    """
    m = ReferenceModel(cfg, weights, kv_dtype)
    logits = m.forward(prompt)[-1]
    out: list[int] = []
    for _ in range(steps):
        top2 = np.partition(logits, -2)[-2:]
        if float(top2[1] - top2[0]) <= 1e-3 * max(float(np.abs(logits).max()), 1e-6):
            break
        t = int(np.argmax(logits))
        out.append(t)
        logits = m.forward([t])[-1]
    return out


def golden_cases(
    cfg: ModelConfig,
    weights: Mapping[str, np.ndarray],
    tokenizer: Tokenizer,
    profiles: Sequence[ProfileManifest],
    steps: int = GOLDEN_STEPS,
) -> list[GoldenCase]:
    """Greedy reference tokens per prompt and profile (computed once per distinct KV dtype)."""
    cases = []
    for text in GOLDEN_PROMPTS:
        prompt = [i for i in tokenizer.encode(text) if i < cfg.vocab_size] or [0]
        by_dtype: dict[str, list[int]] = {}
        expected: dict[int, list[int]] = {}
        for p in profiles:
            if p.kv_dtype not in by_dtype:
                by_dtype[p.kv_dtype] = _greedy_with_margin(cfg, weights, prompt, steps, p.kv_dtype)
            expected[p.compiled_batch] = by_dtype[p.kv_dtype]
        cases.append(GoldenCase(prompt=prompt, expected=expected))
    return cases


def _install(tmp: Path, out: Path, *, replace: bool) -> None:
    """Atomically move the finished ``tmp`` package to ``out``."""
    if out.exists() or out.is_symlink():
        if not replace:
            shutil.rmtree(tmp)
            raise PackageError(f"{out}: already exists (use --force to replace it)")
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        os.rename(out, old)
        os.rename(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, out)


def build_package(
    out: str | os.PathLike[str],
    key: str | os.PathLike[str],
    *,
    name: str,
    config: ModelConfig,
    weights: Mapping[str, np.ndarray],
    tokenizer_json: str,
    special: SpecialTokens,
    profiles: Sequence[int],
    timing: str,
    max_seq: int,
    max_sequences: int | None = None,
    kv_dtype: str = "fp32",
    weights_dtype: str = "BF16",
    chat_template: str | None = CHATML,
    source: str = "",
    replace: bool = False,
) -> Path:
    """Write, sign and atomically install a package. Returns ``out``."""
    bad = [b for b in profiles if b not in DEFAULT_PROFILES]
    if bad or not profiles:
        raise ConfigError(f"--profiles: each must be one of 1, 4, 8, 16 (got {list(profiles)})")
    if kv_dtype not in _KV_BYTES:
        raise ConfigError(f"kv_dtype must be fp32 or bf16, not {kv_dtype!r}")
    tm = TimingManifest.from_timing(timing, timing_profile(timing))
    outp = Path(out).absolute()
    outp.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=outp.parent, prefix=f".{outp.name}.tmp-"))
    try:
        write_safetensors(tmp / WEIGHTS_FILE, weights, weights_dtype)
        stored = load_safetensors(tmp / WEIGHTS_FILE)  # golden on exactly what the runtime loads
        (tmp / "tokenizer.json").write_text(tokenizer_json, "utf-8")
        tok = Tokenizer.from_file(tmp / "tokenizer.json", special.eos_token_ids)
        profs = make_profiles(
            config, profiles, max_seq=max_seq, max_sequences=max_sequences, kv_dtype=kv_dtype
        )
        params = parameter_bytes(config, weights_dtype)
        manifest = Manifest(
            format=FORMAT,
            name=name,
            model=architecture_from_config(config),
            profiles=profs,
            timing=tm,
            capacity=CapacityManifest(
                parameter_bytes=params,
                kv_bytes_per_token=max(p.kv_layout.bytes_per_token for p in profs),
                dram_reservation_bytes={
                    p.compiled_batch: params
                    + p.max_sequences * p.max_seq * p.kv_layout.bytes_per_token
                    + pool_bytes(config, p.compiled_batch)
                    for p in profs
                },
            ),
            special_tokens=special,
            chat_template=chat_template,
            weights=[WEIGHTS_FILE],
            source=source,
        )
        golden = Golden(cases=golden_cases(config, stored, tok, profs))
        (tmp / "golden.json").write_bytes(msgspec.json.encode(golden) + b"\n")
        (tmp / "manifest.json").write_bytes(encode_manifest(manifest))
        sign_package(tmp, key)
        os.chmod(tmp, 0o755)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _install(tmp, outp, replace=replace)
    log.info("packed %s -> %s", name, outp)
    return outp


def pack_from_hf(
    src: str | os.PathLike[str],
    out: str | os.PathLike[str],
    key: str | os.PathLike[str],
    profiles: Sequence[int] = DEFAULT_PROFILES,
    timing: str = "none",
    *,
    max_seq: int = 2048,
    max_sequences: int | None = None,
    kv_dtype: str = "fp32",
    replace: bool = False,
) -> Path:
    """Pack the checkpoint directory ``src`` into the package directory ``out``, signed with ``key``.

    Weights are stored in the checkpoint's dtype (BF16 for real Qwen3), so nothing is rounded twice.
    The chat template is the checkpoint's (``tokenizer_config.json`` ``chat_template``; ChatML when
    it has none), EOS ids come from ``generation_config.json`` (else config / tokenizer_config).
    """
    ck = load_hf_checkpoint(src)
    eos = ck.eos_token_ids
    tok = Tokenizer.from_file(ck.tokenizer_json)
    if not eos:
        i = tok.token_to_id("<|im_end|>") or tok.token_to_id("<|endoftext|>")
        eos = () if i is None else (i,)
    return build_package(
        out,
        key,
        name=Path(src).absolute().name,
        config=ck.config,
        weights=ck.weights,
        tokenizer_json=ck.tokenizer_json.read_text("utf-8"),
        special=SpecialTokens(
            eos_token_ids=list(eos),
            pad_token_id=ck.pad_token_id,
            bos_token_id=ck.bos_token_id,
            bos_token=None if ck.bos_token_id is None else tok.id_to_token(ck.bos_token_id),
            eos_token=tok.id_to_token(eos[0]) if eos else None,
            add_bos_token=ck.add_bos_token,
        ),
        profiles=profiles,
        timing=timing,
        max_seq=min(max_seq, ck.config.max_position_embeddings),
        max_sequences=max_sequences,
        kv_dtype=kv_dtype,
        weights_dtype=ck.source_dtype or "BF16",
        chat_template=ck.chat_template or CHATML,
        source=f"hf:{Path(src).absolute()}" + (f" ({ck.note})" if ck.note else ""),
        replace=replace,
    )


def pack_demo(
    out: str | os.PathLike[str],
    key: str | os.PathLike[str],
    profiles: Sequence[int] = DEFAULT_PROFILES,
    timing: str = "none",
    *,
    replace: bool = False,
) -> Path:
    """Pack the built-in demo model (:mod:`calserve.models.demo_model`) into ``out``."""
    tok_json = demo_model.demo_tokenizer_json()
    cfg = demo_model.demo_model_config(demo_model.tokenizer_vocab_size(tok_json))
    return build_package(
        out,
        key,
        name=demo_model.DEMO_NAME,
        config=cfg,
        weights=demo_model.demo_weights(cfg),
        tokenizer_json=tok_json,
        special=demo_model.demo_special_tokens(tok_json),
        profiles=profiles,
        timing=timing,
        max_seq=demo_model.DEMO_MAX_SEQ,
        max_sequences=demo_model.DEMO_MAX_SEQUENCES,
        source="calserve built-in demo (seeded random weights)",
        replace=replace,
    )
