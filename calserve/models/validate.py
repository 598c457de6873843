"""Static validation of a package and its compatibility with the runtime and the config.

- :func:`validate_manifest`: schema-level sanity of profiles (compiled_batch in {1,4,8,16}, max_seq
  bounds, KV layout consistent with the architecture, the spec §7.3 inactive-lane contract) and the
  tensor index (names/shapes/dtypes vs ``reference.weight_shapes``).
- :func:`runnable_profiles`: which profiles the runtime's capability profile can run (B>1 needs the C3
  batch capability, absent on ``calrt-0.7.6``); none runnable -> refused.
- :func:`check_scheduler_config`: spec §15 last paragraph — a requested profile the package lacks, or
  the runtime cannot run, fails start-up with :class:`ConfigError`.
- :func:`compare_introspection`: spec §11 step 8 — after configure, the runtime's view must match.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from calserve.config import CalserveConfig
from calserve.errors import ConfigError, ValidationError
from calserve.models.manifest import Manifest, ProfileManifest, parameter_bytes
from calserve.runtime.reference import ROPE_FREQS, ModelConfig, weight_shapes
from calserve.runtime.types import RuntimeCapabilities

__all__ = [
    "ALLOWED_BATCHES",
    "TensorInfo",
    "validate_manifest",
    "validate_tensors",
    "runnable_profiles",
    "check_scheduler_config",
    "compare_introspection",
]

ALLOWED_BATCHES = frozenset({1, 4, 8, 16})

# name -> (dtype "BF16"/"F16"/"F32", shape)
TensorInfo = Mapping[str, tuple[str, tuple[int, ...]]]


MAX_SEQ_LIMIT = 1 << 20  # a sanity bound: no compiled profile has a million-token context
_KV_BYTES = {"fp32": 4, "bf16": 2}
_DTYPE_BYTES = {"BF16": 2, "F16": 2, "F32": 4}


def _bad(source: str, msg: str) -> ValidationError:
    return ValidationError(f"{source}: {msg}")


def _model_config(manifest: Manifest, source: str) -> ModelConfig:
    try:
        return manifest.model_config()
    except ValueError as e:
        raise _bad(source, f"model: {e}") from None


def _check_profile(cfg: ModelConfig, p: ProfileManifest, where: str) -> None:
    b = p.compiled_batch
    if b not in ALLOWED_BATCHES:
        raise ValidationError(f"{where}.compiled_batch: {b} is not one of 1, 4, 8, 16")
    if not 1 <= p.max_seq <= min(cfg.max_position_embeddings, MAX_SEQ_LIMIT):
        raise ValidationError(
            f"{where}.max_seq: {p.max_seq} outside 1..{min(cfg.max_position_embeddings, MAX_SEQ_LIMIT)}"
            " (model.max_position_embeddings)"
        )
    if p.max_sequences < b:
        raise ValidationError(
            f"{where}.max_sequences: {p.max_sequences} < compiled_batch {b}: lanes could never fill"
        )
    kl = p.kv_layout
    want = {
        "layers": cfg.num_hidden_layers,
        "kv_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "dtype": p.kv_dtype,
        "bytes_per_token": 2
        * cfg.num_hidden_layers
        * cfg.num_key_value_heads
        * cfg.head_dim
        * _KV_BYTES[p.kv_dtype],
    }
    for k, v in want.items():
        got = getattr(kl, k)
        if got != v:
            raise ValidationError(
                f"{where}.kv_layout.{k}: {got!r} does not match the architecture/kv_dtype ({v!r})"
            )
    # Spec §7.3: without a valid-mask contract a B>1 profile never becomes Ready; a profile whose
    # inactive lanes write KV would corrupt sequences parked on those lanes.
    if b > 1 and not p.inactive_policy.valid_mask:
        raise ValidationError(
            f"{where}: compiled_batch={b} has no valid-mask contract (inactive_policy.valid_mask=false;"
            " spec §7.3)"
        )
    if b > 1 and p.inactive_policy.writes_kv:
        raise ValidationError(
            f"{where}: compiled_batch={b} inactive lanes write KV (inactive_policy.writes_kv=true;"
            " spec §7.3)"
        )
    if b > 1 and p.tier in ("C0", "C1", "C2"):
        raise ValidationError(f"{where}.tier: a compiled_batch={b} profile is C3 or later, not {p.tier}")


def validate_manifest(manifest: Manifest, source: str = "manifest.json") -> None:
    """Everything checkable from the manifest alone. Raises ValidationError naming the field."""
    cfg = _model_config(manifest, source)
    if not manifest.name.strip():
        raise _bad(source, "name is empty")
    if not manifest.exact_submodel.strip():
        raise _bad(source, "exact_submodel is empty")
    if not manifest.profiles:
        raise _bad(source, "profiles is empty")
    seen: set[int] = set()
    for i, p in enumerate(manifest.profiles):
        _check_profile(cfg, p, f"{source}: profiles[{i}]")
        if p.compiled_batch in seen:
            raise _bad(source, f"profiles[{i}].compiled_batch {p.compiled_batch} appears twice")
        seen.add(p.compiled_batch)
    st = manifest.special_tokens
    if not st.eos_token_ids:
        raise _bad(source, "special_tokens.eos_token_ids is empty")
    for name, ids in (
        ("eos_token_ids", st.eos_token_ids),
        ("pad_token_id", [] if st.pad_token_id is None else [st.pad_token_id]),
        ("bos_token_id", [] if st.bos_token_id is None else [st.bos_token_id]),
    ):
        for t in ids:
            if not 0 <= t < cfg.vocab_size:
                raise _bad(source, f"special_tokens.{name}: {t} outside the vocabulary (0..{cfg.vocab_size - 1})")
    cap = manifest.capacity
    if set(cap.dram_reservation_bytes) != seen:
        raise _bad(
            source,
            f"capacity.dram_reservation_bytes covers {sorted(cap.dram_reservation_bytes)},"
            f" profiles are {sorted(seen)}",
        )
    widest = max(p.kv_layout.bytes_per_token for p in manifest.profiles)
    if cap.kv_bytes_per_token != widest:
        raise _bad(source, f"capacity.kv_bytes_per_token {cap.kv_bytes_per_token} != {widest}")
    for b, r in cap.dram_reservation_bytes.items():
        p = manifest.profile(b)
        floor = cap.parameter_bytes + p.max_sequences * p.max_seq * p.kv_layout.bytes_per_token
        if r < floor:
            raise _bad(source, f"capacity.dram_reservation_bytes[{b}] {r} < parameters + KV ({floor})")
    tm = manifest.timing
    for b, us in tm.decode_step_us.items():
        if b not in ALLOWED_BATCHES or us < 0:
            raise _bad(source, f"timing.decode_step_us[{b}]: bad entry {us}")
    if tm.prefill_base_us < 0 or tm.prefill_us_per_token < 0 or not 0.0 <= tm.pingpong_overlap <= 1.0:
        raise _bad(source, "timing: negative time or pingpong_overlap outside 0..1")
    files = [*manifest.weights, manifest.tokenizer, manifest.golden]
    if not manifest.weights:
        raise _bad(source, "weights is empty")
    for f in files:
        if not f or "/" in f or "\\" in f or f in (".", "..") or f.startswith("."):
            raise _bad(source, f"file name {f!r} must be a plain name inside the package")


def validate_tensors(manifest: Manifest, tensors: TensorInfo, source: str = "model.safetensors") -> None:
    """Tensor names/shapes/dtypes vs ``weight_shapes(architecture)``; parameter_bytes consistent."""
    cfg = _model_config(manifest, "manifest.json")
    want = weight_shapes(cfg)
    missing = sorted(set(want) - set(tensors))
    extra = sorted(set(tensors) - set(want))
    if missing:
        raise _bad(source, f"tensor {missing[0]} missing ({len(missing)} missing) for the manifest's architecture")
    if extra:
        raise _bad(source, f"unexpected tensor {extra[0]} ({len(extra)} not in the architecture)")
    dtypes = set()
    for name, shape in want.items():
        dt, got = tensors[name]
        if tuple(got) != shape:
            raise _bad(source, f"tensor {name} has shape {list(got)}, architecture needs {list(shape)}")
        if dt not in _DTYPE_BYTES:
            raise _bad(source, f"tensor {name} has unsupported dtype {dt}")
        if name == ROPE_FREQS:  # always F32 (pack.py: a rounded divisor turns long-range angles)
            if dt != "F32":
                raise _bad(source, f"tensor {name} must be stored F32, not {dt}")
            continue
        dtypes.add(dt)
    if len(dtypes) != 1:
        raise _bad(source, f"mixed tensor dtypes {sorted(dtypes)}")
    pb = parameter_bytes(cfg, dtypes.pop())
    if manifest.capacity.parameter_bytes != pb:
        raise ValidationError(
            f"manifest.json: capacity.parameter_bytes {manifest.capacity.parameter_bytes} != {pb}"
            " (parameter count x stored dtype)"
        )


def runnable_profiles(manifest: Manifest, caps: RuntimeCapabilities) -> dict[int, bool]:
    """compiled_batch -> runnable on ``caps`` (B>1 needs the C3 batch capability).

    Raises ValidationError when none is runnable: such a package can never serve on this runtime.
    """
    out = {p.compiled_batch: p.compiled_batch == 1 or caps.batch_profiles for p in manifest.profiles}
    if not any(out.values()):
        raise ValidationError(
            f"manifest.json: no profile of {manifest.name!r} ({sorted(out)}) is runnable on runtime"
            f" {caps.name} (compiled_batch > 1 needs batch profiles, C3)"
        )
    return dict(sorted(out.items()))


def check_scheduler_config(
    manifest: Manifest, cfg: CalserveConfig, caps: RuntimeCapabilities
) -> list[int]:
    """Cross-check ``scheduler.batch.profiles`` (and ``instance_pool``) with the package and the
    runtime (spec §15 last paragraph); returns the profiles to load (sorted). Raises ConfigError
    naming the key path."""
    batch = cfg.scheduler.batch
    have = set(manifest.compiled_batches)
    requested: list[int] = sorted(set(batch.profiles))
    if not requested:
        raise ConfigError("$.scheduler.batch.profiles: empty; at least one profile is needed")
    for b in requested:
        if b not in have:
            raise ConfigError(
                f"$.scheduler.batch.profiles: B{b} requested but package {manifest.name!r} has only"
                f" {['B%d' % x for x in sorted(have)]}"
            )
        if b > 1 and not caps.batch_profiles:
            raise ConfigError(
                f"$.scheduler.batch.profiles: B{b} cannot run on runtime {caps.name}"
                " (compiled_batch > 1 needs batch profiles, C3; use runtime.profile: sim-next)"
            )
    if batch.instance_pool is not None:
        if batch.instance_pool not in requested:
            raise ConfigError(
                f"$.scheduler.batch.instance_pool: B{batch.instance_pool} is not in"
                f" scheduler.batch.profiles {requested}"
            )
        return [batch.instance_pool]
    if len(requested) > 1 and not caps.multi_calbin:
        raise ConfigError(
            f"$.scheduler.batch.profiles: {requested} cannot co-reside on runtime {caps.name}"
            " (no multi-calbin residency); set scheduler.batch.instance_pool (spec §8)"
        )
    return requested


# Runtimes name dtypes their own way; these spellings mean the manifest's "fp32" / "bf16".
_DTYPE_ALIASES = {"float32": "fp32", "f32": "fp32", "bfloat16": "bf16"}

_INTROSPECT_KEYS: dict[str, Callable[[ProfileManifest, str], object]] = {
    "compiled_batch": lambda p, s: p.compiled_batch,
    "max_seq": lambda p, s: p.max_seq,
    "max_sequences": lambda p, s: p.max_sequences,
    "kv_dtype": lambda p, s: p.kv_dtype,
    "valid_mask": lambda p, s: p.inactive_policy.valid_mask,
    "inactive_logits": lambda p, s: p.inactive_policy.logits_returned,
    "inactive_writes_kv": lambda p, s: p.inactive_policy.writes_kv,
    "exact_submodel": lambda p, s: s,
}


def compare_introspection(manifest: Manifest, compiled_batch: int, info: Mapping[str, Any]) -> None:
    """Spec §11 step 8: ``Calbin.introspect()`` must agree with the manifest; else ValidationError.

    Checks (when the runtime reports them): the profile fields, the KV layout, and every tensor's
    name and shape. ``compiled_batch`` and ``max_seq`` must be reported.
    """
    p = manifest.profile(compiled_batch)
    where = f"introspection of B{compiled_batch}"
    for k in ("compiled_batch", "max_seq"):
        if k not in info:
            raise ValidationError(f"{where}: the runtime did not report {k}")
    for k, get in _INTROSPECT_KEYS.items():
        got_v = _DTYPE_ALIASES.get(info[k], info[k]) if k == "kv_dtype" and k in info else info.get(k)
        if k in info and got_v != get(p, manifest.exact_submodel):
            raise ValidationError(
                f"{where}: {k} = {info[k]!r}, manifest.json says {get(p, manifest.exact_submodel)!r}"
            )
    model = info.get("model")
    if isinstance(model, Mapping):
        for k, v in manifest.model_config().to_dict().items():
            # Float fields may come back as float32 (rms_norm_eps 1e-6 -> 9.99999997e-07).
            close = isinstance(v, float) and isinstance(model.get(k), float) and abs(model[k] - v) <= 1e-6 * abs(v)
            if k in model and model[k] != v and not close:
                raise ValidationError(f"{where}: model.{k} = {model[k]!r}, manifest.json says {v!r}")
    kl = info.get("kv_layout")
    if isinstance(kl, Mapping):
        for k in ("layers", "kv_heads", "head_dim", "dtype", "bytes_per_token"):
            got_v = _DTYPE_ALIASES.get(kl[k], kl[k]) if k == "dtype" and k in kl else kl.get(k)
            if k in kl and got_v != getattr(p.kv_layout, k):
                raise ValidationError(
                    f"{where}: kv_layout.{k} = {kl[k]!r}, manifest.json says {getattr(p.kv_layout, k)!r}"
                )
    tensors = info.get("tensors")
    if tensors is not None:
        want = weight_shapes(manifest.model_config())
        got: dict[str, tuple[int, ...]] = {}
        for t in tensors:
            if isinstance(t, Mapping):
                got[str(t["name"])] = tuple(int(x) for x in t["shape"])
            else:
                got[str(t[0])] = tuple(int(x) for x in t[1])
        if set(got) != set(want):
            diff = sorted(set(got) ^ set(want))
            raise ValidationError(f"{where}: tensor set differs from the manifest's architecture ({diff[0]})")
        for name, shape in want.items():
            if got[name] != shape:
                raise ValidationError(f"{where}: tensor {name} shape {list(got[name])} != {list(shape)}")
