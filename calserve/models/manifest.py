"""The ``calculet-calbin/v1`` package manifest (``manifest.json``), decoded strictly with msgspec.

A package is a directory::

    manifest.json     this schema
    model.safetensors weights (names/shapes of ``reference.weight_shapes``; BF16, F16 or F32)
    tokenizer.json    HF ``tokenizers`` format
    golden.json       prompt token ids -> expected greedy tokens, per compiled profile
    SHA256SUMS        ``<sha256>  <relative path>`` for every other file (sorted)
    SHA256SUMS.sig    detached ed25519 signature of SHA256SUMS (hex public key id + signature)

The manifest says what the compiler produced (spec §2 ``BatchProfile``, §7.3 inactive-lane contract,
§20 vendor deliverables). ``compiled_batch`` comes only from here, never from config (spec §2).
"""

from __future__ import annotations

import math
from typing import Final, Literal

import msgspec

from calserve.errors import ValidationError
from calserve.runtime.reference import ROPE_FREQS, ModelConfig, weight_shapes
from calserve.runtime.types import ProfileSpec, Timing

__all__ = [
    "FORMAT",
    "GOLDEN_FORMAT",
    "ArchitectureManifest",
    "InactivePolicy",
    "KvLayout",
    "ProfileManifest",
    "TimingManifest",
    "CapacityManifest",
    "SpecialTokens",
    "GoldenCase",
    "Golden",
    "Manifest",
    "architecture_from_config",
    "decode_manifest",
    "encode_manifest",
    "decode_golden",
]

FORMAT: Final = "calculet-calbin/v1"
GOLDEN_FORMAT: Final = "calculet-golden/v1"

KvDtype = Literal["fp32", "bf16"]
Tier = Literal["C0", "C1", "C2", "C3", "C4"]


class _Strict(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    pass


class ArchitectureManifest(_Strict, kw_only=True):
    """The fields of :class:`calserve.runtime.reference.ModelConfig` (HF ``config.json`` names).

    ``architecture`` says which decoder: ``Qwen3ForCausalLM`` (per-head q/k RMSNorm),
    ``LlamaForCausalLM`` (none; HF's rotate-half RoPE layout) or ``Qwen2ForCausalLM`` (Llama with
    q/k/v projection biases). ``rope_theta`` is the model's RoPE base
    and ``tie_word_embeddings`` whether the head is the embedding (else ``lm_head.weight`` is stored).
    Packages written before Llama support name no architecture and are Qwen3.
    """

    architecture: Literal["Qwen3ForCausalLM", "LlamaForCausalLM", "Qwen2ForCausalLM",
                          "Gemma3ForCausalLM", "Gemma2ForCausalLM"] = "Qwen3ForCausalLM"
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
    rope_freqs: bool = False  # Llama 3.1+: a model.rope_freqs.weight tensor divides RoPE's frequencies
    max_position_embeddings: int = 40960
    # sliding-window attention, Gemma's local RoPE base and score scale (reference.ModelConfig)
    sliding_window: int = 0
    sliding_window_pattern: int = 0
    rope_local_theta: float = 0.0
    query_pre_attn_scalar: float = 0.0
    rope_scaling_factor: float = 0.0  # linear RoPE scaling (reference.ModelConfig)
    # Gemma 2's attention score and final logit soft-capping (reference.ModelConfig; 0: none)
    attn_logit_softcapping: float = 0.0
    final_logit_softcapping: float = 0.0


class InactivePolicy(_Strict, kw_only=True):
    """Spec §7.3: how a compiled profile treats lanes that carry no sequence."""

    valid_mask: bool  # the profile takes a per-lane valid mask
    logits_returned: bool  # inactive lanes return (zero) logits
    writes_kv: bool  # inactive lanes write KV: such a B>1 profile is refused


class KvLayout(_Strict, kw_only=True):
    """The KV cache layout a profile was compiled for (must agree with the architecture)."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: KvDtype
    bytes_per_token: int  # K and V of every layer for one token


class ProfileManifest(_Strict, kw_only=True):
    """One compiled batch profile (spec §2 ``BatchProfile``)."""

    compiled_batch: int
    max_seq: int
    max_sequences: int  # KV sequences the KvManager is configured for
    token_dtype: Literal["int32"] = "int32"
    logit_dtype: Literal["fp32"] = "fp32"
    kv_dtype: KvDtype = "fp32"
    inactive_policy: InactivePolicy
    kv_layout: KvLayout
    tier: Tier = "C0"


class TimingManifest(_Strict, kw_only=True):
    """Modeled device time for the software runtime (``runtime.types.Timing`` + its name)."""

    name: str = "none"
    prefill_base_us: float = 0.0
    prefill_us_per_token: float = 0.0
    decode_step_us: dict[int, float] = msgspec.field(default_factory=dict)
    pingpong_overlap: float = 0.0

    def to_timing(self) -> Timing:
        return Timing(
            prefill_base_us=self.prefill_base_us,
            prefill_us_per_token=self.prefill_us_per_token,
            decode_step_us=dict(self.decode_step_us),
            pingpong_overlap=self.pingpong_overlap,
        )

    @classmethod
    def from_timing(cls, name: str, t: Timing) -> TimingManifest:
        return cls(
            name=name,
            prefill_base_us=t.prefill_base_us,
            prefill_us_per_token=t.prefill_us_per_token,
            decode_step_us={int(k): float(v) for k, v in t.decode_step_us.items()},
            pingpong_overlap=t.pingpong_overlap,
        )


class CapacityManifest(_Strict, kw_only=True):
    """Compiler capacity figures (spec §13.1, §20). Reservation is per compiled batch."""

    parameter_bytes: int  # device bytes of the weights as stored on the device
    kv_bytes_per_token: int  # of the widest KV dtype among the profiles
    dram_reservation_bytes: dict[int, int]  # compiled_batch -> params + KV + pools


class SpecialTokens(_Strict, kw_only=True):
    """The model's special tokens. ``bos_token``/``eos_token`` are the strings a chat template names
    (``{{ bos_token }}``); ``add_bos_token`` says whether the model expects BOS before a plain prompt
    (the tokenizer's post-processor adds it with ``add_special_tokens=True``; false for SmolLM2)."""

    eos_token_ids: list[int]
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    bos_token: str | None = None
    eos_token: str | None = None
    add_bos_token: bool = False


class GoldenCase(_Strict, kw_only=True):
    prompt: list[int]
    # compiled_batch -> expected greedy tokens (after prefill, ``len`` decode steps); per profile because
    # KV dtype may differ between profiles.
    expected: dict[int, list[int]]


class Golden(_Strict, kw_only=True):
    format: Literal["calculet-golden/v1"] = "calculet-golden/v1"
    cases: list[GoldenCase]


class Manifest(_Strict, kw_only=True):
    """``manifest.json`` of a ``calculet-calbin/v1`` package."""

    format: Literal["calculet-calbin/v1"]
    name: str
    model: ArchitectureManifest
    exact_submodel: str = "decoder"
    profiles: list[ProfileManifest]
    timing: TimingManifest = msgspec.field(default_factory=TimingManifest)
    capacity: CapacityManifest
    special_tokens: SpecialTokens
    chat_template: str | None = None  # None = the documented ChatML default (models.tokenizer)
    weights: list[str] = msgspec.field(default_factory=lambda: ["model.safetensors"])
    tokenizer: str = "tokenizer.json"
    golden: str = "golden.json"
    source: str = ""  # free text: where the weights came from

    def model_config(self) -> ModelConfig:
        m = self.model
        return ModelConfig(
            vocab_size=m.vocab_size,
            hidden_size=m.hidden_size,
            intermediate_size=m.intermediate_size,
            num_hidden_layers=m.num_hidden_layers,
            num_attention_heads=m.num_attention_heads,
            num_key_value_heads=m.num_key_value_heads,
            head_dim=m.head_dim,
            rms_norm_eps=m.rms_norm_eps,
            rope_theta=m.rope_theta,
            tie_word_embeddings=m.tie_word_embeddings,
            max_position_embeddings=m.max_position_embeddings,
            architecture=m.architecture,
            rope_freqs=m.rope_freqs,
            sliding_window=m.sliding_window,
            sliding_window_pattern=m.sliding_window_pattern,
            rope_local_theta=m.rope_local_theta,
            query_pre_attn_scalar=m.query_pre_attn_scalar,
            rope_scaling_factor=m.rope_scaling_factor,
            attn_logit_softcapping=m.attn_logit_softcapping,
            final_logit_softcapping=m.final_logit_softcapping,
        )

    @property
    def compiled_batches(self) -> list[int]:
        return sorted(p.compiled_batch for p in self.profiles)

    def profile(self, compiled_batch: int) -> ProfileManifest:
        for p in self.profiles:
            if p.compiled_batch == compiled_batch:
                return p
        raise ValidationError(
            f"manifest.json: package {self.name!r} has no compiled_batch={compiled_batch} profile "
            f"(has {self.compiled_batches})"
        )

    def profile_spec(self, compiled_batch: int) -> ProfileSpec:
        p = self.profile(compiled_batch)
        return ProfileSpec(
            compiled_batch=p.compiled_batch,
            max_seq=p.max_seq,
            max_sequences=p.max_sequences,
            kv_dtype=p.kv_dtype,
            valid_mask=p.inactive_policy.valid_mask,
            inactive_logits=p.inactive_policy.logits_returned,
            inactive_writes_kv=p.inactive_policy.writes_kv,
            exact_submodel=self.exact_submodel,
        )

    def timing_for(self, compiled_batch: int | None = None) -> Timing:
        """The package's timing model. ``compiled_batch`` only checks the profile exists: one Timing
        carries the per-B decode step table (``decode_step_us``)."""
        if compiled_batch is not None:
            self.profile(compiled_batch)
        return self.timing.to_timing()


def architecture_from_config(cfg: ModelConfig) -> ArchitectureManifest:
    return ArchitectureManifest(**cfg.to_dict())


def decode_manifest(raw: bytes, source: str = "manifest.json") -> Manifest:
    """Decode strictly; a schema error names the file and the JSON path."""
    try:
        return msgspec.json.decode(raw, type=Manifest)
    except msgspec.ValidationError as e:
        raise ValidationError(f"{source}: schema: {e}") from None
    except msgspec.DecodeError as e:
        raise ValidationError(f"{source}: not valid JSON: {e}") from None


def encode_manifest(m: Manifest) -> bytes:
    return msgspec.json.format(msgspec.json.encode(m), indent=2) + b"\n"


def decode_golden(raw: bytes, source: str = "golden.json") -> Golden:
    try:
        return msgspec.json.decode(raw, type=Golden)
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        raise ValidationError(f"{source}: {e}") from None


_DTYPE_BYTES: Final = {"BF16": 2, "F16": 2, "F32": 4}


def parameter_bytes(cfg: ModelConfig, dtype: str) -> int:
    """Bytes of a package's stored tensors: every one in ``dtype`` but RoPE's frequency divisors
    (``model.rope_freqs.weight``), which are always F32."""
    return sum(math.prod(s) * (4 if n == ROPE_FREQS else _DTYPE_BYTES[dtype])
               for n, s in weight_shapes(cfg).items())
